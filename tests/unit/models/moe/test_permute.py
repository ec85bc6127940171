"""permute.py: the gathers into the experts' padded rows and back, against a per-token reference, forward and
backward, eager and compiled; and that no step scatters, accumulates or zero-fills token rows."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.kernels.permute import (
    expert_major_order,
    permute_to_experts,
    permute_tokens,
    plan_permutation,
    unpermute_tokens,
)

TOKENS, TOP_K, NUM_EXPERTS, DIM, ALIGNMENT = 7, 3, 4, 5, 4


def routing(seed: int = 0, unrouted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(TOKENS, TOP_K) expert ids, some -1 (slots another rank's experts take, as DeepEP delivers them), and fp32
    weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    if unrouted:
        ids[torch.rand(TOKENS, TOP_K, generator=gen) < 0.3] = -1
    return ids, torch.rand(TOKENS, TOP_K, generator=gen, dtype=torch.float64)


def plan_for(ids: torch.Tensor, alignment: int | None = ALIGNMENT):
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_EXPERTS)
    return plan_permutation(expert_major_order(ids, NUM_EXPERTS), ids.numel(), counts, alignment), counts


def test_rows_are_the_copies_of_each_expert_in_aligned_groups():
    ids, weights = routing()
    plan, counts = plan_for(ids)
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    rows = permute_tokens(x, plan, TOP_K, weights, torch.float64)
    starts = [0, *plan.group_ends[:-1].tolist()]
    assert (plan.group_ends % ALIGNMENT == 0).all()
    for e in range(NUM_EXPERTS):
        tokens, ks = (ids == e).nonzero(as_tuple=True)  # token order within an expert is kept
        expected = x[tokens] * weights[tokens, ks].unsqueeze(1)
        torch.testing.assert_close(rows[starts[e] : starts[e] + len(tokens)], expected)
        assert (rows[starts[e] + len(tokens) : plan.group_ends[e]] == 0).all()
    assert (rows[plan.group_ends[-1] :] == 0).all()
    assert int(counts.sum()) == int((plan.padded_slot >= 0).sum()) == int((plan.slot_row >= 0).sum())


@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_sums_each_tokens_weighted_copies(weighted):
    ids, weights = routing()
    plan, _ = plan_for(ids)
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    rows = permute_tokens(x, plan, TOP_K, None, torch.float64) * 3  # "experts": times 3
    out = unpermute_tokens(rows, plan, TOP_K, weights if weighted else None, torch.float32)
    slot_weights = torch.where(ids >= 0, weights if weighted else 1.0, 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (3 * x * slot_weights.sum(1, keepdim=True)).float())


@pytest.mark.parametrize("alignment", [ALIGNMENT, None])
def test_gradients_match_finite_differences(alignment):
    ids, weights = routing(1)
    plan, _ = plan_for(ids, alignment)
    x = torch.randn(TOKENS, DIM, dtype=torch.float64, requires_grad=True)
    w = weights.clone().requires_grad_()
    rows = torch.randn(plan.padded_slot.shape[0], DIM, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: permute_tokens(x, plan, TOP_K, w, torch.float64), (x, w))
    assert torch.autograd.gradcheck(lambda r, w: unpermute_tokens(r, plan, TOP_K, w, torch.float64), (rows, w))
    assert torch.autograd.gradcheck(lambda x: permute_tokens(x, plan, TOP_K, None, torch.float64), (x,))


def test_sync_free_padding_gets_no_row_and_no_gradient():
    """DeepEP's worst-case receive: trailing tokens are NaN padding with NaN weights and no expert."""
    ids, weights = routing(2)
    padded_ids = torch.cat([ids, torch.full((3, TOP_K), -1)])
    padded_weights = torch.cat([weights, torch.full((3, TOP_K), float("nan"), dtype=torch.float64)])
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_EXPERTS)
    order = expert_major_order(padded_ids, NUM_EXPERTS)  # full length: the padding slots come last
    x = torch.cat([torch.randn(TOKENS, DIM, dtype=torch.float64), torch.full((3, DIM), float("nan"))])
    x.requires_grad_()
    rows, plan = permute_to_experts(x, order, counts, TOP_K, None, ALIGNMENT, torch.float64)
    out = unpermute_tokens(rows * 2, plan, TOP_K, padded_weights, torch.float64)
    assert torch.isfinite(rows).all() and torch.isfinite(out[:TOKENS]).all() and (out[TOKENS:] == 0).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[TOKENS:] == 0).all()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_matches_eager_forward_and_backward(backend):
    ids, weights = routing(3)
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_EXPERTS)
    order = expert_major_order(ids, NUM_EXPERTS)
    x = torch.randn(TOKENS, DIM)
    permute = torch.compile(permute_to_experts, backend=backend, fullgraph=True)
    unpermute = torch.compile(unpermute_tokens, backend=backend, fullgraph=True)
    results = []
    for perm, unperm in ((permute_to_experts, unpermute_tokens), (permute, unpermute)):
        xi, wi = x.clone().requires_grad_(), weights.float().requires_grad_()
        rows, plan = perm(xi, order, counts, TOP_K, None, ALIGNMENT, torch.bfloat16)
        out = unperm(rows.float().sin(), plan, TOP_K, wi, torch.float32)
        out.pow(2).sum().backward()
        results.append((rows, out, xi.grad, wi.grad))
    for actual, expected in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


def test_no_scatter_accumulate_or_zero_filled_rows_forward_or_backward():
    ids, weights = routing(4)
    counts = torch.bincount(ids[ids >= 0], minlength=NUM_EXPERTS)
    order = expert_major_order(ids, NUM_EXPERTS)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    w = weights.float().requires_grad_()
    with _RecordOps() as recorded:
        rows, plan = permute_to_experts(x, order, counts, TOP_K, None, ALIGNMENT, torch.bfloat16)
        out = unpermute_tokens(rows * 2, plan, TOP_K, w, torch.float32)
        out.backward(torch.randn_like(out))
    float_ops = {name for name, dtype in recorded.ops if dtype is not None and dtype.is_floating_point}
    assert not float_ops & {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_"}
    assert not float_ops & {"zeros", "new_zeros", "zeros_like", "zero_", "full", "new_full", "fill_"}
    assert "index_select" in float_ops
