"""Row gathers `x[index]` with a backward that suits MoE token permutations.

The autograd of `x.index_select(0, index)` (and of `x[index]`) accumulates the gradient with an atomic add in x's
dtype. For bf16 token rows that is slow: on an H200, 65k rows of 7168 take 5.6 ms (inductor leaves it to aten as
well), against < 1 ms for a plain scatter or an fp32 accumulation. MoE gathers are of two kinds:
- `unique=True`: a permutation or selection without repeats (unpadding, rank-major -> expert-major). Backward is a
  scatter, `index_copy`, no accumulation at all;
- `unique=False`: one token copied for several experts. Backward sums the copies' gradients in (at least) fp32
  and casts once, which is also more accurate than a bf16 running sum.
"""

import torch

__all__ = ["gather_rows"]


def gather_rows(x: torch.Tensor, index: torch.Tensor, unique: bool) -> torch.Tensor:
    """x (R, ...), index (M,) int64 -> x[index] (M, ...). `unique`: index has no repeated entries (not checked)."""
    return _GatherRows.apply(x, index, unique)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, index: torch.Tensor, unique: bool) -> torch.Tensor:
        return x.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, index, unique = inputs
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        ctx.unique = unique

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        shape = (ctx.num_rows, *grad.shape[1:])
        if ctx.unique:
            return grad.new_zeros(shape).index_copy(0, index, grad), None, None
        accumulate = torch.promote_types(grad.dtype, torch.float32)  # fp32, or fp64 for fp64
        summed = grad.new_zeros(shape, dtype=accumulate).index_add(0, index, grad.to(accumulate))
        return summed.to(grad.dtype), None, None
