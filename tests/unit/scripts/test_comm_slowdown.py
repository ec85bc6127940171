"""The communication-bound testbed (`scripts/bench/comm_slowdown.py`) multiplies every exchange, forward and
backward, by its factor, and changes no output or gradient: all-to-all and DeepEP (CPU kernels) on gloo ranks,
plain, under activation checkpointing and in the two-micro-batch overlap schedule."""

from collections import Counter
from functools import partial

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from scripts.bench.comm_slowdown import SlowedDispatcher
from tests.unit.distributed._spawn import run_distributed
from torchtitan.config import JobConfig
from torchtitan.distributed.activation_checkpoint import per_op_sac_contexts
from torchtitan.distributed.deepep import destroy_buffers
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION, LocalTokenDispatcher
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.moe.exchange import ExchangeContext, get_backend
from torchtitan.models.moe.overlap import MicroBatchOverlap

DIM, HIDDEN, FACTOR = 16, 32, 3
EXCHANGE_OPS = ("all_to_all_single", "deepep.dispatch", "deepep.combine", "deepep.cached_dispatch")


class _CountExchanges(TorchDispatchMode):
    """Counts the communication ops that run under it (forward, or backward on this thread as on CPU)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        for op in EXCHANGE_OPS:
            if op in name:
                self.calls[op] += 1
        return func(*args, **(kwargs or {}))


def _build(backend: str, mesh, factor: int | None) -> MoE:
    """The layer with `backend`'s dispatcher, wrapped in a `SlowedDispatcher` of `factor` (None: not wrapped)."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, num_shared_experts=1, top_k=3, score_func="sigmoid", route_norm=True)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.02)
    exchange = get_backend(backend)
    context = ExchangeContext(JobConfig(), EAGER_PERMUTATION, on_cuda=False)
    moe = exchange.layer(moe, context)
    parallelize_module(moe, mesh, exchange.style(context))
    if factor is not None:
        moe.dispatcher = SlowedDispatcher(moe.dispatcher, factor)
    return moe


def _tokens(rank: int) -> torch.Tensor:
    # uneven batches: ranks route different numbers of tokens
    return torch.randn(2, 3 + 4 * rank, DIM, generator=torch.Generator().manual_seed(rank))


def _run(moe: MoE, forward) -> tuple[torch.Tensor, torch.Tensor, dict, Counter, Counter]:
    """-> output, input gradient, parameter gradients, exchanges in forward, exchanges in backward."""
    x = _tokens(int(torch.distributed.get_rank())).requires_grad_()
    with _CountExchanges() as forward_calls:
        out = forward(moe, x)
    with _CountExchanges() as backward_calls:
        (out * out).sum().backward()
    grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for name, p in moe.named_parameters()}
    return out, x.grad, grads, forward_calls.calls, backward_calls.calls


def _overlapped(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The trainer's overlap schedule on the two sequences of x as micro-batches (inline on CPU)."""
    return MicroBatchOverlap(comm_stream=None)(moe.stages, x)


def _slowed_matches_plain(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    sac = partial(per_op_sac_contexts, get_backend("deepep").sac_save_ops())
    forwards = {
        "plain": lambda moe, x: moe(x),
        "full AC": lambda moe, x: checkpoint(moe, x, use_reentrant=False),
        "per-op SAC": lambda moe, x: checkpoint(moe, x, use_reentrant=False, context_fn=sac),
        "overlap": _overlapped,
    }
    for backend in ("standard", "deepep"):
        for name, forward in forwards.items():
            reference = _run(_build(backend, mesh, None), forward)
            slowed = _run(_build(backend, mesh, FACTOR), forward)
            what = f"{backend}, {name}"
            for got, expected in zip(slowed[:2], reference[:2], strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=what)
            for param, grad in slowed[2].items():
                torch.testing.assert_close(grad, reference[2][param], rtol=0, atol=0, msg=f"{what}: {param}")
            for direction, got, expected in zip(("forward", "backward"), slowed[3:], reference[3:], strict=True):
                assert expected and got == {op: FACTOR * n for op, n in expected.items()}, (what, direction, got)
    destroy_buffers()


def test_slowed_exchange_repeats_forward_and_backward_and_keeps_results_on_2_ranks():
    run_distributed(_slowed_matches_plain, 2)


@pytest.mark.parametrize("factor", [0, -1, 1.5])
def test_factor_below_one_or_fractional_is_a_clear_error(factor):
    with pytest.raises(ValueError, match="integer >= 1"):
        SlowedDispatcher(LocalTokenDispatcher(num_experts=4), factor)


def test_slowed_dispatcher_takes_backend_experts_and_scoring_from_the_inner_one():
    inner = LocalTokenDispatcher(num_experts=4, score_before_experts=True)
    slowed = SlowedDispatcher(inner, 2)
    assert (slowed.backend, slowed.num_experts, slowed.score_before_experts) == ("local", 4, True)
