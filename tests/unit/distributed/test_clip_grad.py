"""clip_grad_norm_ over parameters that live on different meshes (dense FSDP vs experts EP x FSDP) and PP stages;
grad_norm_and_clip_coef + MultiTensorAdamW's folded clipping equal it on DTensor parameters."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.unit.distributed._model_parity import batch, build_reference, job_config, loss_of, tiny_args
from tests.unit.distributed._spawn import run_distributed
from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_, grad_norm_and_clip_coef
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
from torchtitan.models.moe.exchange import resolve_exchange


def _mixed_meshes(rank: int, world_size: int) -> None:
    reference = build_reference(tiny_args())
    inputs, labels = batch()
    loss_of(reference(inputs), labels, labels.numel()).backward()
    ref_grads = [p.grad for p in reference.parameters()]
    ref_norm = torch.nn.utils.get_total_norm(ref_grads)
    max_norm = float(ref_norm) / 4  # forces clipping by a factor of ~4

    cfg = job_config(parallelism__expert_parallel_degree=2)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.build_mesh("cpu")
    model = parallelize_deepseekv3(copy.deepcopy(reference), dims, cfg, resolve_exchange(cfg)).model
    meshes = {p.device_mesh for p in model.parameters()}
    assert len(meshes) == 2, meshes  # dense params on dp_shard, experts on (dp_shard_mod_ep, ep)
    size = dims.get_mesh("dp").size()
    local_inputs, local_labels = inputs.chunk(size)[rank], labels.chunk(size)[rank]
    loss_of(model(local_inputs), local_labels, labels.numel()).backward()

    norm = clip_grad_norm_(model.parameters(), max_norm, pp_mesh=None)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    clipped = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in model.parameters()])
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-4, atol=1e-6)

    # pipeline stages: each pp rank holds different parameters; the norm covers both stages
    pp_dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=2, ep=1, etp=1, world_size=world_size)
    pp_dims.build_mesh("cpu")
    pp_rank = pp_dims.get_mesh("pp").get_local_rank()
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(pp_rank + 1))  # stage 0: |g|^2 = 3, stage 1: |g|^2 = 12
    norm = clip_grad_norm_([param], max_norm=1e9, pp_mesh=pp_dims.get_mesh("pp"))
    torch.testing.assert_close(norm, torch.tensor(15.0).sqrt())
    dist.barrier()


def test_clip_grad_norm_across_meshes_and_stages():
    run_distributed(_mixed_meshes, 4)


def _dtensor_params(meshes) -> list[torch.nn.Parameter]:
    """Sharded evenly and unevenly, replicated, on a 2-D mesh, and one plain tensor; the same values on every rank.
    One replicated parameter's gradient holds partial sums (as under tensor parallelism)."""
    flat, square = meshes
    gen = torch.Generator().manual_seed(0)
    layouts = [((6, 3), flat, [Shard(0)]), ((5,), flat, [Shard(0)]), ((4,), flat, [Replicate()]),
               ((3, 4), square, [Replicate(), Shard(1)])]  # fmt: skip
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, placements))
        for shape, mesh, placements in layouts
    ]
    for param in params:
        param.grad = distribute_tensor(torch.randn(param.shape, generator=gen), param.device_mesh, param.placements)
    partial = torch.nn.Parameter(distribute_tensor(torch.randn(3, generator=gen), flat, [Replicate()]))
    partial.grad = DTensor.from_local(torch.randn(3, generator=gen), flat, [Partial()], run_check=False)
    plain = torch.nn.Parameter(torch.randn(2, generator=gen))
    plain.grad = torch.randn(2, generator=gen)
    return [*params, partial, plain]


def _folded_clip_on_dtensors(rank: int, world_size: int) -> None:
    meshes = (init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")))
    ours, ref = _dtensor_params(meshes), _dtensor_params(meshes)
    full_grads = [p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad for p in ref]
    max_norm = float(torch.nn.utils.get_total_norm(full_grads)) / 3
    ours_optimizer = MultiTensorAdamW(ours, lr=0.1, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1)
    for _ in range(2):
        ref_norm = clip_grad_norm_(ref, max_norm)
        norm, coef = grad_norm_and_clip_coef(ours, max_norm)
        torch.testing.assert_close(norm, ref_norm)
        torch.testing.assert_close(coef, torch.tensor(1 / 3), rtol=1e-4, atol=0)
        ours_optimizer.step(grad_scale=coef)
        ref_optimizer.step()
        for ours_param, ref_param in zip(ours, ref, strict=True):
            torch.testing.assert_close(ours_param, ref_param)
            torch.testing.assert_close(
                ours_optimizer.state[ours_param]["exp_avg"], ref_optimizer.state[ref_param]["exp_avg"]
            )
        for ours_param, ref_param in zip(ours, ref, strict=True):  # ref's were clipped in place, ours were not
            ref_param.grad = ours_param.grad.clone()
    dist.barrier()


def test_folded_clipping_equals_clip_grad_norm_on_dtensor_params():
    run_distributed(_folded_clip_on_dtensors, 2)
