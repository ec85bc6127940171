"""CompiledRegion: one graph for every token-row count, and the recompile guard of checkpointed MoE blocks.

With natural routing each MoE layer hands its compiled regions another number of rows. A region that compiled a
static graph first and a dynamic one later lets an activation-checkpoint recompute replay another graph than its
forward ran (CheckpointError in backward, seen with inductor). These tests pin the three parts of the fix: one graph
for all sizes (0 and 1 rows included), eager-equal gradients through checkpointed layers of different sizes under
inductor, and a named error if a region ever compiles between a block's forward and its recompute.
"""

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torchtitan.distributed.compile import (
    CompiledRegion,
    RecompiledDuringCheckpointError,
    recompile_guard_contexts,
)
from torchtitan.kernels.permute import permute_to_experts, plan_permutation, unpermute_tokens
from torchtitan.models.moe.experts import run_experts_grouped_mm

NUM_EXPERTS, DIM, HIDDEN, ALIGNMENT = 4, 16, 32, 8


def _expert_weights(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = [(NUM_EXPERTS, HIDDEN, DIM), (NUM_EXPERTS, DIM, HIDDEN), (NUM_EXPERTS, HIDDEN, DIM)]
    return [(torch.randn(s, generator=gen, dtype=dtype) * 0.1).requires_grad_() for s in shapes]


def _counts(rows: int) -> torch.Tensor:
    """Split `rows` unevenly over the experts (some get none), like a skewed router."""
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    counts[0] = rows - rows // 3
    counts[2] = rows // 3
    return counts


def _received(rows: int, top_k: int = 2):
    """What DeepEP delivers for `rows` token copies: (num_recv, DIM) tokens, their routed slots in expert-major
    order, the copies per expert and (num_recv, top_k) weights."""
    gen = torch.Generator().manual_seed(rows)
    num_recv = (rows + top_k - 1) // top_k
    slots = torch.randperm(num_recv * top_k, generator=gen)[:rows]
    return torch.randn(num_recv, DIM, generator=gen), slots, _counts(rows), torch.rand(num_recv, top_k, generator=gen)


PLAN_DIMS = {"padded_slot": 0, "slot_row": 0}


def test_one_graph_serves_every_row_count_including_0_and_1():
    torch._dynamo.reset()
    permute = CompiledRegion(permute_to_experts, "aot_eager", {0: 0, 1: 0, 4: 0})
    unpermute = CompiledRegion(unpermute_tokens, "aot_eager", {0: 0, 1: PLAN_DIMS, 3: 0})
    for rows in (37, 5, 0, 1, 64):
        x, slots, counts, weights = _received(rows)
        got, plan = permute(x, slots, counts, 2, weights, ALIGNMENT, torch.float32)
        want, want_plan = permute_to_experts(x, slots, counts, 2, weights, ALIGNMENT, torch.float32)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(plan.slot_row, want_plan.slot_row)
        back = unpermute(got, plan, 2, weights, torch.float32)
        torch.testing.assert_close(back, unpermute_tokens(want, want_plan, 2, weights, torch.float32))
    assert permute.num_graphs == 1 and unpermute.num_graphs == 1


def _layer(region, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return region(x, _counts(x.shape[0]), *weights, ALIGNMENT)


def test_checkpointed_layers_of_different_sizes_match_eager_under_inductor():
    """Three checkpointed 'layers' run DeepEP's weighted sum per received token on 40, 24 and 56 copies; backward
    recomputes each. Before the fix inductor compiled a static graph for the first size and a dynamic one for the
    second, the recompute of the first layer replayed the dynamic graph, and backward raised a CheckpointError."""
    torch._dynamo.reset()
    region = CompiledRegion(unpermute_tokens, "inductor", {0: 0, 1: PLAN_DIMS, 3: 0})
    layers = []
    for rows in (40, 24, 56):
        x, slots, counts, weights = _received(rows)
        plan = plan_permutation(slots, weights.numel(), counts, ALIGNMENT)
        layers.append((torch.randn(plan.padded_slot.shape[0], DIM), plan, weights))
    leaves = [t.requires_grad_() for output, _, weights in layers for t in (output, weights)]

    def loss(run):
        return sum((run(output, plan, 2, weights, torch.float32) ** 2).sum() for output, plan, weights in layers)

    compiled = loss(lambda *args: checkpoint(region, *args, use_reentrant=False))
    grads = torch.autograd.grad(compiled, leaves)
    eager = loss(unpermute_tokens)
    eager_grads = torch.autograd.grad(eager, leaves)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert region.num_graphs == 1


def _toy_experts(x, counts, w1, w2, w3, alignment):
    """Pad, grouped GEMMs, unpad."""
    order = torch.arange(x.shape[0])
    rows, plan = permute_to_experts(x, order, counts, 1, None, alignment, torch.bfloat16)
    return unpermute_tokens(run_experts_grouped_mm(rows, plan.group_ends, w1, w2, w3), plan, 1, None, x.dtype)


def test_experts_region_serves_every_row_count_including_none():
    """An expert-parallel rank may receive no tokens at all: the experts then get only padding rows."""
    torch._dynamo.reset()
    region = CompiledRegion(_toy_experts, "aot_eager", {0: 0})
    weights = _expert_weights()
    for rows in (37, 0, 1, 16):
        x = torch.randn(rows, DIM, requires_grad=True)
        got = _layer(region, x, weights)
        (got_grad,) = torch.autograd.grad(got.square().sum(), x)
        want = _layer(_toy_experts, x, weights)
        (want_grad,) = torch.autograd.grad(want.square().sum(), x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    assert region.num_graphs == 1


def test_recompile_between_forward_and_recompute_is_a_named_error():
    torch._dynamo.reset()
    region = CompiledRegion(_toy_experts, "aot_eager", {0: 0})
    weights = _expert_weights()
    x = torch.randn(24, DIM)
    out = checkpoint(
        partial(_layer, region),
        x,
        weights,
        use_reentrant=False,
        context_fn=partial(recompile_guard_contexts, "layers.3", (region,)),
    )
    # Another dtype cannot reuse the graph: the region compiles again, inside the next layer's checkpoint, before
    # the recompute of layers.3. (A graph compiled outside every checkpoint is not counted: the standard
    # dispatcher's fp32 gather back after the combine; test_activation_checkpoint.py.)
    checkpoint(
        partial(_layer, region),
        x.double(),
        [w.detach().double() for w in weights],
        use_reentrant=False,
        context_fn=partial(recompile_guard_contexts, "layers.4", (region,)),
    )
    with pytest.raises(RecompiledDuringCheckpointError, match=r"_toy_experts.*layers\.3"):
        out.sum().backward()


def test_guard_is_silent_when_nothing_recompiles():
    torch._dynamo.reset()
    region = CompiledRegion(_toy_experts, "aot_eager", {0: 0})
    weights = _expert_weights()
    outs = [
        checkpoint(
            partial(_layer, region),
            torch.randn(rows, DIM),
            weights,
            use_reentrant=False,
            context_fn=partial(recompile_guard_contexts, f"layers.{i}", (region,)),
        )
        for i, rows in enumerate((24, 9, 40))
    ]
    sum(o.sum() for o in outs).backward()
    assert all(w.grad is not None for w in weights)
