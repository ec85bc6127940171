"""Token permutation for the routed experts: one gather into padded expert-major rows, one gather back.

Every dispatcher ends up with this rank's token copies as flat (token, k) slots of some (T, top_k) routing table in
an expert-major `order`. `plan_permutation` turns that order into the layout the grouped GEMMs read:

    padded_slot (P,)      the slot each padded expert-major row holds, -1 on padding rows
    slot_row    (T * k,)  the padded row of each slot, -1 for slots no local expert takes
    group_ends  (E,)      int32 cumulative padded group ends (`torch._grouped_mm`'s offs)

Each group is padded to the GEMMs' alignment. The two maps are inverses, so both directions are gathers:

    permute_tokens:   rows[r] = w[s] * x[s // k]           (s = padded_slot[r]; zero on padding rows)
        backward:     grad_x[t] = sum_j w[t, j] * grad_rows[slot_row[t, j]]          (a gather and a top-k sum)
    unpermute_tokens: out[t] = sum_j w[t, j] * rows[slot_row[t, j]]                  (fp32 sum, one cast)
        backward:     grad_rows[r] = w[s] * grad_out[s // k]                           (a gather)

(w = 1 where no weights are applied.) Plain PyTorch ops: inductor fuses each gather with its mask, weighting,
reduction and cast into one kernel, and the same code is the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "PermutePlan",
    "expert_major_order",
    "permute_to_experts",
    "permute_tokens",
    "plan_permutation",
    "unpermute_tokens",
]


@dataclass
class PermutePlan:
    padded_slot: torch.Tensor  # (P,) int64, -1 on padding rows
    slot_row: torch.Tensor  # (num_slots,) int64, -1 for slots no local expert takes
    group_ends: torch.Tensor  # (E,) int32


def plan_permutation(
    order: torch.Tensor, num_slots: int, tokens_per_expert: torch.Tensor, alignment: int | None
) -> PermutePlan:
    """order (C,) int64: slots in expert-major order; its first sum(tokens_per_expert) entries are routed, the rest (if
    any: DeepEP's sync-free worst-case sizes) belong to no expert. tokens_per_expert (E,). alignment: pad each group to
    a multiple of it, at least one (an empty GEMM group's weight gradient would rely on the kernel writing zeros);
    P = C rounded up + E * alignment, a static bound. None: no padding, P = C (a send buffer ordered by expert)."""
    num_rows = order.shape[0]
    counts = tokens_per_expert.to(torch.int64)
    ends = counts.cumsum(0)
    rows = torch.arange(num_rows, device=order.device)
    routed = rows < ends[-1]
    if alignment is None:
        num_padded, row_to_padded, group_ends = num_rows, rows, ends
    else:
        num_experts = counts.shape[0]
        padded_counts = ((counts + alignment - 1) // alignment * alignment).clamp_min(alignment)
        group_ends = padded_counts.cumsum(0)
        expert_of_row = torch.searchsorted(ends, rows, right=True).clamp_max(num_experts - 1)
        row_to_padded = (group_ends - padded_counts)[expert_of_row] + rows - (ends - counts)[expert_of_row]
        num_padded = (num_rows + alignment - 1) // alignment * alignment + num_experts * alignment
    # Unrouted entries are written to one extra element past the end, then dropped.
    padded_slot = torch.full((num_padded + 1,), -1, dtype=torch.int64, device=order.device)
    padded_slot = padded_slot.scatter(0, torch.where(routed, row_to_padded, num_padded), order)[:num_padded]
    slot_row = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=order.device)
    slot_row = slot_row.scatter(0, torch.where(routed, order, num_slots), torch.where(routed, row_to_padded, -1))
    return PermutePlan(padded_slot, slot_row[:num_slots], group_ends.to(torch.int32))


def permute_tokens(
    x: torch.Tensor, plan: PermutePlan, top_k: int, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """x (T, dim) -> (P, dim) in `dtype`: row r holds x[padded_slot[r] // top_k], times its routing weight if
    `weights` (T, top_k) fp32 is given; padding rows are zero."""
    return _PermuteTokens.apply(x, plan.padded_slot, plan.slot_row, top_k, weights, dtype)


def unpermute_tokens(
    rows: torch.Tensor, plan: PermutePlan, top_k: int, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """rows (P, dim) -> (T, dim) in `dtype`: per token the sum of its slots' rows (fp32 sum when top_k > 1 or
    weighted), times the slots' routing weights if `weights` (T, top_k) fp32 is given; slots no local expert
    takes contribute nothing."""
    return _UnpermuteTokens.apply(rows, plan.padded_slot, plan.slot_row, top_k, weights, dtype)


def _gather_slots(
    x: torch.Tensor, padded_slot: torch.Tensor, top_k: int, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(T, dim) -> (P, dim): row r = w[s] * x[s // top_k], s = padded_slot[r]; zero where s < 0."""
    # Padding rows read one zero row appended to x (and weight 0): an index that is valid even when x has no rows
    # (a rank may receive no tokens). Compiled, the append is a masked load inside the gather, not a copy.
    num_tokens = x.shape[0]
    valid = padded_slot >= 0
    rows = F.pad(x, (0, 0, 0, 1)).index_select(0, torch.where(valid, padded_slot // top_k, num_tokens))
    if weights is not None:
        slot = torch.where(valid, padded_slot, weights.numel())
        slot_weights = F.pad(weights.reshape(-1), (0, 1)).index_select(0, slot)
        rows = rows.to(_at_least_fp32(rows)) * slot_weights.unsqueeze(1)
    return _cast(rows, dtype)


def _sum_slots(
    rows: torch.Tensor, slot_row: torch.Tensor, top_k: int, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(P, dim) -> (T, dim): token t = sum_j w[t, j] * rows[slot_row[t * top_k + j]]; slots < 0 count zero."""
    valid = (slot_row >= 0).unsqueeze(1)
    per_slot = rows.index_select(0, slot_row.clamp_min(0))  # (T * top_k, dim)
    if top_k == 1 and weights is None:
        return _cast(torch.where(valid, per_slot, 0), dtype)
    per_slot = per_slot.to(_at_least_fp32(per_slot))
    if weights is not None:
        per_slot = per_slot * weights.reshape(-1, 1)
    per_slot = torch.where(valid, per_slot, 0)
    return _cast(per_slot.view(-1, top_k, rows.shape[1]).sum(dim=1), dtype)


def _slot_weight_grad(rows: torch.Tensor, slot_row: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """The gradient of slot (t, j)'s weight: <rows[slot_row[t, j]], tokens[t]>, zero for slots < 0 -> (T, top_k)."""
    per_slot = rows.index_select(0, slot_row.clamp_min(0)).view(-1, top_k, rows.shape[1])  # (T, k, dim)
    dots = (per_slot.to(_at_least_fp32(rows)) * tokens.to(_at_least_fp32(tokens)).unsqueeze(1)).sum(-1)
    return torch.where((slot_row >= 0).view(-1, top_k), dots, 0)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, with no `.to` when it already is: under torch.compile on torch 2.11, an autograd.Function whose
    forward returns a no-op `.to()` gets zero gradients. Remove once torch 2.11 is no longer supported."""
    return t if t.dtype == dtype else t.to(dtype)


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(x, padded_slot, slot_row, top_k, weights, dtype):
        return _gather_slots(x, padded_slot, top_k, weights, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, padded_slot, slot_row, top_k, weights, _ = inputs
        ctx.top_k, ctx.x_dtype = top_k, x.dtype
        ctx.save_for_backward(slot_row, weights, x if weights is not None else None)

    @staticmethod
    def backward(ctx, grad_rows):
        slot_row, weights, x = ctx.saved_tensors
        grad_x = _sum_slots(grad_rows, slot_row, ctx.top_k, weights, ctx.x_dtype)
        grad_weights = None
        if weights is not None and ctx.needs_input_grad[4]:
            grad_weights = _cast(_slot_weight_grad(grad_rows, slot_row, x, ctx.top_k), weights.dtype)
        return grad_x, None, None, None, grad_weights, None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(rows, padded_slot, slot_row, top_k, weights, dtype):
        return _sum_slots(rows, slot_row, top_k, weights, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, padded_slot, slot_row, top_k, weights, _ = inputs
        ctx.top_k, ctx.rows_dtype = top_k, rows.dtype
        ctx.save_for_backward(padded_slot, slot_row, weights, rows if weights is not None else None)

    @staticmethod
    def backward(ctx, grad_out):
        padded_slot, slot_row, weights, rows = ctx.saved_tensors
        grad_rows = _gather_slots(grad_out, padded_slot, ctx.top_k, weights, ctx.rows_dtype)
        grad_weights = None
        if weights is not None and ctx.needs_input_grad[4]:
            grad_weights = _cast(_slot_weight_grad(rows, slot_row, grad_out, ctx.top_k), weights.dtype)
        return grad_rows, None, None, None, grad_weights, None


def expert_major_order(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Positions of the flattened `expert_ids` (-1: no expert) sorted stably by expert, the -1 entries last:
    (expert_ids.numel(),) int64, the one ordering every backend uses.

    The keys sort as int16 (num_experts < 32767): 2 radix passes instead of int64's 8, fewer host launches right
    after DeepEP's dispatch, where the GPU waits for them. The 15-bit mask sends -1 (0xFFFF) after every expert."""
    if num_experts >= 2**15 - 1:
        raise ValueError(f"expert_major_order sorts int16 keys: num_experts={num_experts} must be below 32767")
    keys = expert_ids.reshape(-1).to(torch.int16).bitwise_and(2**15 - 1)
    return torch.argsort(keys, stable=True)


def permute_to_experts(
    x: torch.Tensor,
    order: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None,
    alignment: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, PermutePlan]:
    """x (T, dim), order (C,) slots of (T, top_k) in expert-major order -> (rows, plan): every backend's copies in
    padded expert-major rows, scaled by `weights` (T, top_k) if given, and the plan that maps them back."""
    plan = plan_permutation(order, x.shape[0] * top_k, tokens_per_expert, alignment)
    return permute_tokens(x, plan, top_k, weights, dtype), plan
