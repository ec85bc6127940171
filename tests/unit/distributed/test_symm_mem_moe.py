"""An `MoE` under `SymmMemExpertParallel` on gloo ranks: parity with the standard all-to-all EP (eager, per-op SAC,
full recompute, compiled), the capacity factor's drops (the same as DeepEP's, counted in the backward), the CUDA
kernels' lanes through a stand-in for NVSHMEM, and the backend's preflight check."""

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from tests.unit.distributed._spawn import run_distributed
from tests.unit.distributed._symm_mem_stand_in import install_stand_in
from tests.unit.distributed._tiny_moe import DIM, TOP_K, build_moe
from torchtitan.distributed import symm_mem_all_to_all as ops
from torchtitan.distributed.activation_checkpoint import per_op_sac_contexts
from torchtitan.distributed.expert_parallel.deepep_dispatcher import DeepEPExpertParallel
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.distributed.expert_parallel.symm_mem_dispatcher import SymmMemExpertParallel
from torchtitan.distributed.group_buffers import release_group_buffers
from torchtitan.models.moe import MoE
from torchtitan.models.moe.deepep_moe import DeepEPMoE
from torchtitan.models.moe.exchange import SymmMemBackend

NUM_TOKENS = 10


def _symm_mem_moe(mesh, capacity_factor: float | None = None, **kwargs) -> MoE:
    moe = build_moe(**kwargs)
    parallelize_module(moe, mesh, SymmMemExpertParallel(NUM_TOKENS, capacity_factor))
    return moe


def _standard_moe(mesh, **kwargs) -> MoE:
    moe = build_moe(**kwargs)
    parallelize_module(moe, mesh, ExpertParallel())
    return moe


def _tokens(rank: int) -> torch.Tensor:
    # every rank routes the same number of tokens (the exchange's receive bound assumes it), different ones
    return torch.randn(2, NUM_TOKENS // 2, DIM, generator=torch.Generator().manual_seed(rank))


def _grads(moe: MoE) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in moe.named_parameters()}


def _run(moe: MoE, x: torch.Tensor, wrap=None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward (through wrap(moe, x) if given) and backward of a fixed upstream gradient: (out, x.grad, grads)."""
    x = x.clone().requires_grad_()
    out = wrap(moe, x) if wrap is not None else moe(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * upstream).sum().backward()
    return out.detach(), x.grad, _grads(moe)


def _assert_same(got, want, label: str, **tolerance) -> None:
    torch.testing.assert_close(got[0], want[0], msg=f"{label}: output", **tolerance)
    torch.testing.assert_close(got[1], want[1], msg=f"{label}: input gradient", **tolerance)
    for name, grad in got[2].items():  # the router gate too: the gradient of the routing weights
        torch.testing.assert_close(grad, want[2][name], msg=f"{label}: {name}", **tolerance)


def _parity_and_checkpointing(rank: int, world_size: int) -> None:
    """The standard EP's outputs and gradients, eager (both weightings, both expert kernels), under the trainer's
    per-op SAC (no communication recomputed) and under full recompute (every exchange once more)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    x = _tokens(rank)
    for kwargs in ({}, {"score_before_experts": True}, {"use_grouped_mm": True}):
        reference = _run(_standard_moe(mesh, **kwargs), x)
        _assert_same(_run(_symm_mem_moe(mesh, **kwargs), x), reference, f"eager {kwargs}")

    exchanges = []
    all_to_all_single = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: exchanges.append(1) or all_to_all_single(*args, **kwargs)
    sac_context = partial(per_op_sac_contexts, SymmMemBackend(max_tokens=64).sac_save_ops())
    runs = {}
    for label, wrap in (
        ("plain", None),
        ("per-op SAC", partial(checkpoint, use_reentrant=False, context_fn=sac_context)),
        ("full recompute", partial(checkpoint, use_reentrant=False)),
    ):
        exchanges.clear()
        runs[label] = _run(_symm_mem_moe(mesh), x, wrap), len(exchanges)
    dist.all_to_all_single = all_to_all_single
    # forward: the counts, dispatch and combine; backward: combine's and dispatch's reverse exchanges
    assert [count for _, count in runs.values()] == [5, 5, 8], runs
    for label in ("per-op SAC", "full recompute"):
        _assert_same(runs[label][0], runs["plain"][0], label)


def _capacity_drops_like_deepep_and_counts_them(rank: int, world_size: int) -> None:
    """A capacity factor: 8 x the balanced load drops nothing (the dropless outputs), half of it drops copies
    exactly as DeepEP's sync-free dispatch with that factor does; the experts get ranks x capacity rows, and the
    backward counts (dropped, routed) copies."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    x = _tokens(rank)
    routed = NUM_TOKENS * TOP_K
    dropless = _run(_symm_mem_moe(mesh), x)
    generous = _symm_mem_moe(mesh, capacity_factor=8.0)
    _assert_same(_run(generous, x), dropless, "factor 8")
    assert generous.capacity_drops.tolist() == [0, routed]

    tight = _symm_mem_moe(mesh, capacity_factor=0.5)
    deepep = build_moe(DeepEPMoE)
    parallelize_module(deepep, mesh, DeepEPExpertParallel(sync_free=True, capacity_factor=0.5))
    got = _run(tight, x)
    _assert_same(got, _run(deepep, x), "factor 0.5 vs deepep")
    assert not torch.allclose(got[0], dropless[0])
    scores, selected = tight.drop_past_capacity(*tight.route(x))
    dropped = int((selected < 0).sum())
    assert dropped > 0 and tight.capacity_drops.tolist() == [dropped, routed]

    capacity = math.ceil(0.5 * routed / world_size)
    with torch.no_grad():
        expert_tokens, _ = tight.dispatcher.dispatch(x.view(-1, DIM), selected, scores)
    assert expert_tokens.order.numel() == world_size * capacity
    assert int(expert_tokens.counts.sum()) <= world_size * capacity
    release_group_buffers()


def _compiled_matches_eager(rank: int, world_size: int) -> None:
    torch._dynamo.config.capture_scalar_outputs = True
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    x = _tokens(rank)
    for factor in (None, 0.5):
        moe = _symm_mem_moe(mesh, capacity_factor=factor)
        eager = _run(moe, x)
        moe.zero_grad()
        compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
        _assert_same(_run(moe, x, lambda _, x, fn=compiled: fn(x)), eager, f"compiled, capacity factor {factor}")


def _module_checks(rank: int, world_size: int) -> None:
    _parity_and_checkpointing(rank, world_size)
    _capacity_drops_like_deepep_and_counts_them(rank, world_size)
    _compiled_matches_eager(rank, world_size)


def test_symm_mem_moe_2_ranks_parity_checkpointing_capacity_and_compile():
    # one spawn for all module checks: starting processes costs more than the checks
    run_distributed(_module_checks, 2)


def _cuda_kernels_alternate_lanes(rank: int, world_size: int) -> None:
    """Through the CUDA kernels (on CPU, NVSHMEM's all-to-all-v stood in for): the standard EP's results with full
    recompute, no two consecutive exchanges refilling the same send buffer (a peer may still be reading it), and
    padding rows that hold stale bytes (NaN) never used."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    x = _tokens(rank)
    reference = _run(_standard_moe(mesh), x)
    stand_in = install_stand_in()
    rows = NUM_TOKENS * TOP_K
    ops.get_or_create_buffers(mesh.get_group(), rows, world_size * rows, DIM * 4, 8)
    moe = _symm_mem_moe(mesh)
    _assert_same(_run(moe, x, partial(checkpoint, use_reentrant=False)), reference, "full recompute")
    sends = stand_in.send_buffers
    assert len(sends) == 3 + 3 + 2  # forward, its recompute, backward
    assert all(a != b for a, b in zip(sends, sends[1:], strict=False)), sends
    release_group_buffers()


def test_cuda_kernels_alternate_lanes_across_forward_recompute_and_backward_2_ranks():
    run_distributed(_cuda_kernels_alternate_lanes, 2)


class _Dims:
    def __init__(self, tp=1, pp=1, ep=2):
        self.tp, self.pp, self.ep = tp, pp, ep


def test_check_names_what_symm_mem_needs(monkeypatch):
    for dims in (_Dims(tp=2), _Dims(pp=2)):
        with pytest.raises(ValueError, match="needs CUDA with NVSHMEM, an EP group within one host and tensor_"):
            SymmMemBackend(max_tokens=64).check(dims, dim=128)
    SymmMemBackend(max_tokens=64).check(_Dims(), dim=128)  # no CUDA here: nothing else to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed._symmetric_memory, "is_nvshmem_available", lambda: False)
    with pytest.raises(ImportError, match="pip install nvidia-nvshmem-cu13"):
        SymmMemBackend(max_tokens=64).check(_Dims(), dim=128)
