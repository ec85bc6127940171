"""Muon on the parameters `parallelize_deepseekv3` lays out (FSDP, HSDP, TP with FSDP's strided shards, EP with FSDP
over experts or over their rows, ETP): the same gradients give the single-process weights, and every matrix is
orthogonalized once per group of ranks that share its shards (not on each of them)."""

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.unit.distributed._model_parity import build_reference, job_config, parallelized, tiny_args
from tests.unit.distributed._spawn import run_distributed
from torchtitan.components import muon
from torchtitan.components.muon import Muon
from torchtitan.components.optimizer import build_optimizers

CASES = {
    "fsdp4": dict(parallelism__data_parallel_shard_degree=4),
    "hsdp2x2": dict(parallelism__data_parallel_replicate_degree=2),
    "tp2_fsdp2": dict(parallelism__tensor_parallel_degree=2),  # colwise TP + FSDP: strided shards
    "ep2_fsdp4": dict(parallelism__expert_parallel_degree=2),
    "ep4_experts_outside_fsdp": dict(parallelism__expert_parallel_degree=4),
    "tp2_ep2_etp2": dict(
        parallelism__tensor_parallel_degree=2,
        parallelism__expert_parallel_degree=2,
        parallelism__expert_tensor_parallel_degree=2,
    ),
}
# one expert per EP rank and two FSDP ranks over it: FSDP shards the experts' rows (a matrix dimension)
TWO_EXPERTS_CASE = ("ep2_fsdp4_experts_rows_sharded", dict(parallelism__expert_parallel_degree=2))
STEPS = 3


def _muon_config(overrides: dict):
    cfg = job_config(**overrides)
    cfg.optimizer.name = "Muon"
    cfg.optimizer.lr = 0.02
    return cfg


def _set_gradients(step: int, reference: torch.nn.Module, model: torch.nn.Module) -> None:
    """The same random gradient for each parameter of both models (the model's laid out like its parameter)."""
    gen = torch.Generator().manual_seed(step)
    params = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in model.named_parameters()}
    for name, ref_param in reference.named_parameters():
        grad = torch.randn(ref_param.shape, generator=gen)
        ref_param.grad = grad.clone()
        param = params[name]
        if isinstance(param, DTensor):
            grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
        param.grad = grad


def _matrices_per_copy(param: torch.Tensor, world_size: int) -> int:
    """How many times the ranks together orthogonalize `param`'s matrices: once per set of ranks that hold
    all of its shards (replicas repeat the work, as they repeat every update)."""
    matrices = math.prod(param.shape[:-2])
    sharded_ranks = math.prod(
        param.device_mesh.size(i)
        for i, placement in enumerate(param.placements)
        if placement.is_shard() or isinstance(placement, _StridedShard)
    )
    return matrices * world_size // sharded_ranks


def _check_layout(name: str, args, overrides: dict, world_size: int) -> None:
    reference = build_reference(args)
    cfg = _muon_config(overrides)
    model, _ = parallelized(reference, cfg, world_size)
    ref_optimizers, optimizers = build_optimizers([reference], cfg), build_optimizers([model], cfg)

    orthogonalized = [0]
    iterate = muon.newton_schulz

    def counting(matrices: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        orthogonalized[0] += math.prod(matrices.shape[:-2])
        return iterate(matrices, *args, **kwargs)

    muon.newton_schulz = counting
    try:
        for step in range(STEPS):
            _set_gradients(step, reference, model)
            ref_optimizers.step()
            orthogonalized[0] = 0
            optimizers.step()
    finally:
        muon.newton_schulz = iterate

    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    for param_name, ref_param in reference.named_parameters():
        param = params[param_name]
        value = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
        torch.testing.assert_close(value, ref_param.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    (muon_optimizer,) = [o for o in optimizers if isinstance(o, Muon)]
    muon_params = muon_optimizer.param_groups[0]["params"]
    expected = sum(_matrices_per_copy(p, world_size) for p in muon_params)
    total = torch.tensor(orthogonalized[0])
    dist.all_reduce(total)
    assert int(total) == expected, (name, int(total), expected)


def _all_layouts(rank: int, world_size: int) -> None:
    for name, overrides in CASES.items():
        _check_layout(name, tiny_args(), overrides, world_size)
    name, overrides = TWO_EXPERTS_CASE
    args = tiny_args()
    _check_layout(name, replace(args, moe_args=replace(args.moe_args, num_experts=2, top_k=1)), overrides, world_size)


def test_muon_under_every_layout_matches_one_process_and_spreads_the_work():
    run_distributed(_all_layouts, 4)
