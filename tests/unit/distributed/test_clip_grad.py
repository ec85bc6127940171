"""clip_grad_norm_ over parameters that live on different meshes (dense FSDP vs experts EP x FSDP) and PP stages."""

import copy

import torch
import torch.distributed as dist

from tests.unit.distributed._model_parity import batch, build_reference, job_config, loss_of, tiny_args
from tests.unit.distributed._spawn import run_distributed
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3


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
    model = parallelize_deepseekv3(copy.deepcopy(reference), dims, cfg)
    meshes = {p.device_mesh for p in model.parameters()}
    assert len(meshes) == 2, meshes  # dense params on dp_shard, experts on (dp_shard_mod_ep, ep)
    size = dims.get_mesh("dp").size()
    local_inputs, local_labels = inputs.chunk(size)[rank], labels.chunk(size)[rank]
    loss_of(model(local_inputs), local_labels, labels.numel()).backward()

    norm = clip_grad_norm_(model.parameters(), max_norm, pp_mesh=None, ep_enabled=True)
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
