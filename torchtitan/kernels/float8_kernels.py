"""Triton kernels for the FP8 experts' quantization: one pass over each operand (CUDA only).

Left to inductor, the amax + scale + cast of `float8.py` compiles into reductions slower than the FP8 GEMMs save.
These kernels read each operand once (rowwise) or, per-group columns, twice (the second read mostly from L2), and
write the layout the GEMM reads. They compute exactly what `float8.py`'s torch versions compute (same fp32
arithmetic, IEEE-rounded division), which remain the CPU path and the tests' reference. `float8.py` wraps them in
custom ops with fake kernels, opaque to torch.compile.
"""

import torch
import triton
import triton.language as tl

__all__ = [
    "quantize_columns_per_group_cuda",
    "quantize_rowwise_cuda",
    "quantize_rowwise_stacked_cuda",
    "transpose_slabs_cuda",
]

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_EPS = 1e-12


@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    group_ends_ptr,
    col_scale_ptr,
    num_cols,
    num_groups,
    rows_per_slab,
    out_rows_per_slab,
    out_row_offset,
    GROUP_SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # where the row goes: rows come in slabs (an expert's weight) written at an offset into larger output slabs
    out_row = row // rows_per_slab * out_rows_per_slab + out_row_offset + row % rows_per_slab
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GROUP_SCALED:  # the row times its group's column scales (rows past the last group: the last group's)
        groups = tl.arange(0, BLOCK_G)
        ends = tl.load(group_ends_ptr + groups, mask=groups < num_groups, other=0x7FFFFFFF)
        group = tl.minimum(tl.sum((ends <= row).to(tl.int32), axis=0), num_groups - 1).to(tl.int64)
        x = x * tl.load(col_scale_ptr + group * num_cols + cols, mask=mask, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
    q = tl.clamp(x * tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + out_row * num_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + out_row, tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX))


def quantize_rowwise_cuda(
    x: torch.Tensor, col_scale: torch.Tensor | None = None, offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., C) contiguous, C <= 16384 -> (fp8 (..., C), fp32 scales (...)); see float8.quantize_rowwise.
    With col_scale (G, C) fp32 and offsets (G,), x (M, C) is grouped: float8.quantize_rowwise_group_scaled."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    num_rows = scale.numel()
    group_ends, num_groups = None, 1
    if col_scale is not None:  # each row's group is found in the kernel (the ends <= its index)
        group_ends, col_scale, num_groups = offsets.to(torch.int32), col_scale.float().contiguous(), col_scale.shape[0]
    _launch_rowwise(x, q, scale, num_rows, num_rows, 0, group_ends, col_scale, num_groups)
    return q, scale


def quantize_rowwise_stacked_cuda(weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (E, N_i, K) contiguous -> (fp8 (E, sum N_i, K), scales (E, sum N_i)), each weight's rows written
    straight into its place in the stack; see float8._rowwise_stacked."""
    (num_experts, _, k), rows = weights[0].shape, sum(w.shape[1] for w in weights)
    q = torch.empty(num_experts, rows, k, dtype=torch.float8_e4m3fn, device=weights[0].device)
    scale = torch.empty(num_experts, rows, dtype=torch.float32, device=weights[0].device)
    offset = 0
    for w in weights:
        _launch_rowwise(w, q, scale, w.shape[1], rows, offset)
        offset += w.shape[1]
    return q, scale


def _launch_rowwise(
    x, q, scale, rows_per_slab, out_rows_per_slab, out_row_offset, group_ends=None, col_scale=None, num_groups=1
):
    """Row r of x (rows of C) -> row (r // rows_per_slab) * out_rows_per_slab + out_row_offset + r % rows_per_slab
    of q and scale: the identity for one slab, or an expert's weight rows placed into a stack."""
    num_cols = x.shape[-1]
    block = triton.next_power_of_2(num_cols)
    group_scaled = col_scale is not None
    _rowwise_kernel[(x.numel() // num_cols,)](
        x,
        q,
        scale,
        group_ends if group_scaled else scale,  # unused without group scales
        col_scale if group_scaled else scale,
        num_cols,
        num_groups,
        rows_per_slab,
        out_rows_per_slab,
        out_row_offset,
        GROUP_SCALED=group_scaled,
        BLOCK=block,
        BLOCK_G=triton.next_power_of_2(num_groups),
        FP8_MAX=_FP8_MAX,
        EPS=_EPS,
        num_warps=8 if block >= 4096 else 4,
    )


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": block_m, "BLOCK_C": block_c}, num_warps=warps)
        for block_m, block_c, warps in ((64, 64, 4), (128, 64, 8), (64, 128, 8), (32, 128, 4), (128, 32, 4))
    ],
    key=["num_cols"],
)
@triton.jit
def _columns_per_group_kernel(
    t_ptr,
    ends_ptr,
    q_ptr,
    scale_ptr,
    num_rows,
    num_cols,
    num_groups,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    """One (column block, group): the column maxima over the group's rows, then the scaled cast of the same rows
    (read again, mostly from L2), stored transposed. Group `num_groups` zeroes the rows past the last end."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    group = tl.program_id(1)
    col_mask = cols < num_cols
    in_group = group < num_groups
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(ends_ptr + group, mask=in_group, other=num_rows)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    if in_group:
        for row0 in range(start, end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            mask = (rows < end)[:, None] & col_mask[None, :]
            t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(t.to(tl.float32)), axis=0))
        amax = tl.maximum(amax, EPS)
        fp8_max = tl.zeros_like(amax) + FP8_MAX
        tl.store(scale_ptr + group * num_cols + cols, tl.math.div_rn(amax, fp8_max), mask=col_mask)
    inverse = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, tl.maximum(amax, EPS))
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_mask[None, :]
        t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
        q = tl.clamp(t.to(tl.float32) * inverse[None, :], -FP8_MAX, FP8_MAX)
        q = tl.where(in_group, q, 0.0)  # padding rows may hold anything, even NaN
        out = q_ptr + cols.to(tl.int64)[:, None] * num_rows + rows[None, :]
        tl.store(out, tl.trans(q).to(q_ptr.dtype.element_ty), mask=tl.trans(mask))


_TILES = [
    triton.Config({"BLOCK_M": block_m, "BLOCK_C": block_c}, num_warps=warps)
    for block_m, block_c, warps in ((64, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8))
]


@triton.jit
def _tile_column_amax_kernel(
    t_ptr, partial_ptr, num_rows, num_cols, end_ptr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr
):
    """One (row tile, column tile): the column maxima of |t| over the tile's rows before the group's end."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_cols
    mask = (rows < tl.load(end_ptr))[:, None] & col_mask[None, :]
    t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
    tile_amax = tl.max(tl.abs(t.to(tl.float32)), axis=0)
    tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * num_cols + cols, tile_amax, mask=col_mask)


@triton.jit
def _column_amax_kernel(
    partial_ptr,
    amax_ptr,
    scale_ptr,
    num_tiles,
    num_cols,
    BLOCK_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    """One column block: the maxima over the row tiles' column maxima, and the columns' scales."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_cols
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tile in range(0, num_tiles):
        amax = tl.maximum(amax, tl.load(partial_ptr + tile * num_cols + cols, mask=col_mask, other=0.0))
    amax = tl.maximum(amax, EPS)
    tl.store(amax_ptr + cols, amax, mask=col_mask)
    tl.store(scale_ptr + cols, tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX), mask=col_mask)


@triton.autotune(configs=_TILES, key=["num_cols"])
@triton.jit
def _tile_column_cast_kernel(
    t_ptr,
    amax_ptr,
    q_ptr,
    num_rows,
    num_cols,
    end_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    """One (row tile, column tile): times FP8_MAX / the column maxima, cast, stored transposed; rows from the
    group's end on are zero."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < num_cols
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
    amax = tl.maximum(tl.load(amax_ptr + cols, mask=col_mask, other=1.0), EPS)
    q = tl.clamp(t.to(tl.float32) * tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)[None, :], -FP8_MAX, FP8_MAX)
    q = tl.where((rows < tl.load(end_ptr))[:, None], q, 0.0)  # padding rows may hold anything, even NaN
    out = q_ptr + cols.to(tl.int64)[:, None] * num_rows + rows[None, :]
    tl.store(out, tl.trans(q).to(q_ptr.dtype.element_ty), mask=tl.trans(mask))


def _quantize_columns_one_group(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_columns_per_group_cuda` for one group (a dense linear's operand), over row x column tiles: the
    per-group kernel would run only C / BLOCK_C programs, each walking every row. Tile maxima, their maximum over
    the tiles with the scales, then the cast: three launches."""
    num_rows, num_cols = t.shape
    end = offsets.to(torch.int32)
    block_m, block_c = 64, 128
    num_tiles = triton.cdiv(num_rows, block_m)
    partial = torch.empty(num_tiles, num_cols, dtype=torch.float32, device=t.device)
    tiles = (triton.cdiv(num_cols, block_c), num_tiles)
    _tile_column_amax_kernel[tiles](t, partial, num_rows, num_cols, end, BLOCK_M=block_m, BLOCK_C=block_c)
    amax = torch.empty(num_cols, dtype=torch.float32, device=t.device)
    scale = torch.empty(1, num_cols, dtype=torch.float32, device=t.device)
    _column_amax_kernel[(triton.cdiv(num_cols, 256),)](
        partial, amax, scale, num_tiles, num_cols, BLOCK_C=256, FP8_MAX=_FP8_MAX, EPS=_EPS
    )

    def grid(meta):
        return (triton.cdiv(num_cols, meta["BLOCK_C"]), triton.cdiv(num_rows, meta["BLOCK_M"]))

    q = torch.empty(num_cols, num_rows, dtype=torch.float8_e4m3fn, device=t.device)
    _tile_column_cast_kernel[grid](t, amax, q, num_rows, num_cols, end, FP8_MAX=_FP8_MAX, EPS=_EPS)
    return q, scale


def quantize_columns_per_group_cuda(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C) contiguous, groups of rows ending at `offsets` (G,) -> (fp8 t^T (C, M), fp32 scales (G, C)); rows
    past the last end are zero. See float8.quantize_columns_per_group."""
    if offsets.shape[0] == 1:
        return _quantize_columns_one_group(t, offsets)
    num_rows, num_cols = t.shape
    num_groups = offsets.shape[0]
    q = torch.empty(num_cols, num_rows, dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.empty(num_groups, num_cols, dtype=torch.float32, device=t.device)

    def grid(meta):
        return (triton.cdiv(num_cols, meta["BLOCK_C"]), num_groups + 1)

    _columns_per_group_kernel[grid](
        t, offsets.to(torch.int32), q, scale, num_rows, num_cols, num_groups, FP8_MAX=_FP8_MAX, EPS=_EPS
    )
    return q, scale


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, num_rows, num_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (BLOCK_R, BLOCK_C) tile of one slab: src (E, R, C) -> dst (E, C, R), both row-major."""
    slab_start = tl.program_id(2).to(tl.int64) * num_rows * num_cols
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    tile = tl.load(src_ptr + slab_start + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask)
    out = dst_ptr + slab_start + cols.to(tl.int64)[:, None] * num_rows + rows[None, :]
    tl.store(out, tl.trans(tile), mask=tl.trans(mask))


def transpose_slabs_cuda(t: torch.Tensor) -> torch.Tensor:
    """t (E, R, C) contiguous, 1-byte elements (FP8 weights) -> (E, C, R) contiguous, through tiles in shared memory:
    eager's strided copy reads or writes one byte per 32-byte sector (1.6 ms for a 16B layer's 0.55 GB, 8x this)."""
    num_slabs, num_rows, num_cols = t.shape
    out = torch.empty((num_slabs, num_cols, num_rows), dtype=t.dtype, device=t.device)
    block = 64
    grid = (triton.cdiv(num_rows, block), triton.cdiv(num_cols, block), num_slabs)
    src, dst = t.view(torch.uint8), out.view(torch.uint8)  # bytes: no FP8 loads or stores needed
    _transpose_kernel[grid](src, dst, num_rows, num_cols, BLOCK_R=block, BLOCK_C=block)
    return out
