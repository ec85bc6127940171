"""Process-group setup, determinism, and gradient clipping across the meshes of one model."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.kernels.multi_tensor import sum_of_squares

logger = logging.getLogger(__name__)

reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
"""torch.distributed's reduce-scatter of one tensor: `reduce_scatter_single` from torch 2.13 on, which deprecates the
old name (a FutureWarning on every call); the GPU image's torch 2.11 has only `reduce_scatter_tensor`."""
all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
"""torch.distributed's all-gather into one tensor: `all_gather_single` from torch 2.13 on, which deprecates
`all_gather_into_tensor` (a FutureWarning on every call), the only name in the GPU image's torch 2.11."""

__all__ = [
    "all_gather_tensor",
    "autocast_dtype",
    "clip_grad_norm_",
    "grad_norm_and_clip_coef",
    "device_type",
    "init_distributed",
    "reduce_scatter_tensor",
    "set_determinism",
    "set_pg_timeouts",
    "transformer_blocks",
]


def device_type() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def autocast_dtype(parallel_dims: Any, param_dtype: str) -> torch.dtype | None:
    """The dtype a forward autocasts to for `training.mixed_precision_param` (None: no autocast). FSDP2 computes in
    the parameter dtype it casts to; a one-device run gets it from autocast instead, as torchtitan does. With TP or PP
    and no FSDP, compute stays fp32 and a warning says so."""
    if param_dtype == "float32" or parallel_dims.fsdp_enabled:
        return None
    if parallel_dims.tp_enabled or parallel_dims.pp_enabled:
        logger.warning(
            f"training.mixed_precision_param={param_dtype} applies through FSDP, and this run (tensor or pipeline "
            "parallel only) has none: compute stays float32"
        )
        return None
    return getattr(torch, param_dtype)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model.layers`, then the blocks of the multi-token prediction modules (`model.mtp`, if any): the units that
    EP, FSDP and compile treat alike."""
    return [*model.layers.values(), *getattr(model, "mtp", {}).values()]


def unwrapped_block(block: torch.nn.Module) -> torch.nn.Module:
    """The transformer block behind an activation-checkpoint wrapper (the block itself when it has none)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def init_distributed(comm_config: Any, device_type: str) -> None:
    """Initialize the default process group from torchrun's environment: NCCL for CUDA tensors plus gloo for CPU
    ones (CPU offload, host-side metadata), gloo on CPU. The timeout is `comm.init_timeout_seconds` until
    `set_pg_timeouts` switches to the training timeout."""
    if dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=comm_config.init_timeout_seconds))


def set_pg_timeouts(timeout_seconds: int, world_mesh: DeviceMesh) -> None:
    """Apply the training timeout to every process group, after the first step (which may compile / warm up). Barrier
    first so no rank still waits in a collective that was started under the long init timeout."""
    timeout = timedelta(seconds=timeout_seconds)
    if world_mesh.device_type == "cuda":
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()
    # The mesh's submeshes created their own groups; the c10d registry holds all of them (default group included).
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def destroy_process_groups() -> None:
    """Destroy every process group and free it now, while the interpreter is fully alive: destroy_process_group()
    only unregisters the groups, and meshes (kept by DTensor's caches) hold them in `_pg_registry`, so they would be
    freed during interpreter finalization, where a gloo thread taking the GIL aborts the process
    (pytorch/pytorch#190489). Remove once torch frees them itself. Callers drop their own references (model,
    optimizer, DeepEP buffers) first."""
    if not dist.is_initialized():
        return
    gc.collect()  # reference cycles (the model, FSDP states) hold groups
    dist.destroy_process_group()
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # not isinstance: DeviceMesh's metaclass would touch every object (warnings)
            getattr(obj, "_pg_registry", {}).clear()
    gc.collect()


def set_determinism(world_mesh: DeviceMesh | None, device: torch.device, seed: int | None, deterministic: bool) -> int:
    """Seed every RNG identically on all ranks (so a full-model init is the same everywhere); returns the seed.
    seed=None draws one on rank 0 and broadcasts it. deterministic=True turns on deterministic algorithms (slower;
    needed for bitwise-reproducible runs on GPU)."""
    if seed is None:
        seed_tensor = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
        if world_mesh is not None and world_mesh.size() > 1:
            dist.broadcast(seed_tensor, src=0)
        seed = int(seed_tensor.item())
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip gradients to the total 2-norm over all parameters of all meshes and pipeline stages; returns that norm
    (before clipping) as a 0-dim tensor. DTensor gradients on different meshes (dense params on (dp, tp), experts on
    (dp_shard_mod_ep, ep)) cannot be stacked, so each (mesh, placements) group's norm is made a plain tensor with
    full_tensor(): total = (sum_g norm_g^2)^(1/2), the squares summed over the pp mesh."""
    groups = _params_by_grad_mesh(parameters)
    group_norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in group], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        group_norms.append(norm.float())
    if not group_norms:
        total = torch.zeros((), dtype=torch.float32)
    else:
        total = torch.stack([n.to(group_norms[0].device) for n in group_norms]).pow(2.0).sum()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total.to(pp_mesh.device_type)
        dist.all_reduce(total, group=pp_mesh.get_group())
    total = total.pow(1.0 / 2.0)

    # torch's clipping, one mesh at a time (a foreach op takes DTensors of one mesh): a multi-tensor kernel per
    # device and dtype instead of a mul_ per gradient
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@torch.no_grad()
def grad_norm_and_clip_coef(
    parameters: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The total gradient 2-norm over all meshes and pipeline stages, as `clip_grad_norm_` computes it, and torch's
    clip coefficient min(1, max_norm / (norm + 1e-6)): two 0-dim fp32 tensors that stay on the device (no host sync).
    The gradients are NOT clipped (partial sums are reduced to their parameter's layout, in place): an optimizer
    folds the coefficient into its update (`OptimizersContainer.step(grad_scale=coef)`). Each (mesh, placements)
    group's local sum of squares is one `sum_of_squares` launch, summed over the mesh dims where the gradient is
    sharded, then over `pp_mesh`."""
    parameters = list(parameters)
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            # Partial sums have no local norm (e.g. a tensor-parallel layer's replicated weight): reduce them once
            # here to the parameter's layout, which torch's optimizers and clip_grad_norm_ do implicitly
            param.grad = grad.redistribute(param.device_mesh, param.placements)
    group_sums = []
    for params in _params_by_grad_mesh(parameters).values():
        grads = [param.grad for param in params]
        if not isinstance(grads[0], DTensor):
            group_sums.append(sum_of_squares(grads))
            continue
        mesh, placements = grads[0].device_mesh, grads[0].placements
        local_sum = sum_of_squares([grad.to_local() for grad in grads])
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(local_sum, group=mesh.get_group(mesh_dim))
        group_sums.append(local_sum)
    if not group_sums:
        total = torch.zeros((), dtype=torch.float32)
    else:
        total = torch.stack([group_sum.to(group_sums[0].device) for group_sum in group_sums]).sum()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total.to(pp_mesh.device_type)
        dist.all_reduce(total, group=pp_mesh.get_group())
    norm = total.sqrt()
    return norm, torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _params_by_grad_mesh(parameters: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """Parameters with a gradient, by their gradient's (mesh, placements) (None for plain tensors): DTensors of
    different meshes cannot meet in one foreach op."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            grad = param.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return groups
