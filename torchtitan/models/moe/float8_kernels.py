"""Triton kernels for the FP8 experts' quantization: one pass over each operand (CUDA only).

Left to inductor, the amax + scale + cast of `float8.py` compiles into reductions that run at a fraction of the
memory bandwidth and cost more than the FP8 GEMMs save (benchmarks/NOTES.md). These kernels read each operand once
(rowwise: a whole row in registers) or twice (per-group columns: the maxima, then the scaled cast), and write the
layout the GEMM reads. They compute exactly what the torch versions in `float8.py` compute (same formulas, same
fp32 arithmetic with IEEE-rounded division, not Triton's approximate `/`), which remain the CPU path and the
reference of tests/gpu/test_float8.py.

`float8.py` wraps them in custom ops with fake kernels, opaque to torch.compile.
"""

import torch
import triton
import triton.language as tl

__all__ = ["quantize_columns_per_group_cuda", "quantize_rowwise_cuda"]

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_EPS = 1e-12


@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    group_of_row_ptr,
    col_scale_ptr,
    num_cols,
    num_groups,
    GROUP_SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GROUP_SCALED:  # the row times its group's column scales (rows past the last group: the last group's)
        group = tl.minimum(tl.load(group_of_row_ptr + row), num_groups - 1).to(tl.int64)
        x = x * tl.load(col_scale_ptr + group * num_cols + cols, mask=mask, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
    q = tl.clamp(x * tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX))


def quantize_rowwise_cuda(
    x: torch.Tensor, col_scale: torch.Tensor | None = None, offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., C) contiguous, C <= 16384 -> (fp8 (..., C), fp32 scales (...)); see float8.quantize_rowwise.
    With col_scale (G, C) fp32 and offsets (G,), x (M, C) is grouped: float8.quantize_rowwise_group_scaled."""
    num_cols = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    num_rows = x.numel() // num_cols
    block = triton.next_power_of_2(num_cols)
    group_scaled = col_scale is not None
    if group_scaled:
        rows = torch.arange(num_rows, device=x.device, dtype=torch.int32)
        group_of_row = torch.searchsorted(offsets.to(torch.int32), rows, right=True).to(torch.int32)
        col_scale, num_groups = col_scale.float().contiguous(), col_scale.shape[0]
    else:
        group_of_row, col_scale, num_groups = scale, scale, 1  # unused
    _rowwise_kernel[(num_rows,)](
        x,
        q,
        scale,
        group_of_row,
        col_scale,
        num_cols,
        num_groups,
        GROUP_SCALED=group_scaled,
        BLOCK=block,
        FP8_MAX=_FP8_MAX,
        EPS=_EPS,
        num_warps=8 if block >= 4096 else 4,
    )
    return q, scale


@triton.jit
def _group_column_amax_kernel(
    t_ptr, starts_ptr, ends_ptr, amax_ptr, num_cols, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr
):
    """Column maxima of |t| over one SPLIT-th of a group's rows, merged into amax (zero-initialised) atomically:
    groups are few and uneven, so splitting them keeps every SM busy."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_cols
    start = tl.load(starts_ptr + group)
    end = tl.load(ends_ptr + group)
    chunk = tl.cdiv(end - start, SPLIT * BLOCK_M) * BLOCK_M
    lo = start + tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, end)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for row0 in range(lo, hi, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        mask = (rows < hi)[:, None] & col_mask[None, :]
        t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(t.to(tl.float32)), axis=0))
    tl.atomic_max(amax_ptr + group * num_cols + cols, amax, mask=col_mask)


@triton.jit
def _group_column_quantize_kernel(
    t_ptr,
    group_of_row_ptr,
    amax_ptr,
    q_ptr,
    num_rows,
    num_cols,
    num_groups,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Scaled cast of a (BLOCK_M, BLOCK_C) tile, stored transposed into the (C, M) output; rows past the last group
    end are zeroed."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    group = tl.load(group_of_row_ptr + rows, mask=row_mask, other=num_groups)
    in_group = group < num_groups
    safe_group = tl.where(in_group, group, 0)
    amax = tl.load(amax_ptr + safe_group[:, None] * num_cols + cols[None, :], mask=mask, other=1.0)
    t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scaled = tl.clamp(t * tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax), -FP8_MAX, FP8_MAX)
    q = tl.where(in_group[:, None], scaled, 0.0)
    tl.store(q_ptr + cols.to(tl.int64)[None, :] * num_rows + rows[:, None], q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_columns_per_group_cuda(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C) contiguous, groups of rows ending at `offsets` (G,) -> (fp8 t^T (C, M), fp32 scales (G, C)); rows
    past the last end are zero. See float8.quantize_columns_per_group."""
    num_rows, num_cols = t.shape
    num_groups = offsets.shape[0]
    ends = offsets.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(num_rows, device=t.device, dtype=torch.int32)
    group_of_row = torch.searchsorted(ends, rows, right=True).to(torch.int32)
    amax = torch.zeros(num_groups, num_cols, dtype=torch.float32, device=t.device)
    _group_column_amax_kernel[(num_groups, triton.cdiv(num_cols, 128), 8)](
        t, starts, ends, amax, num_cols, SPLIT=8, BLOCK_M=32, BLOCK_C=128, num_warps=4
    )
    amax = amax.clamp_min(_EPS)
    q = torch.empty(num_cols, num_rows, dtype=torch.float8_e4m3fn, device=t.device)
    grid = (triton.cdiv(num_rows, 16), triton.cdiv(num_cols, 64))
    _group_column_quantize_kernel[grid](
        t, group_of_row, amax, q, num_rows, num_cols, num_groups, BLOCK_M=16, BLOCK_C=64, FP8_MAX=_FP8_MAX, num_warps=4
    )
    return q, amax / _FP8_MAX
