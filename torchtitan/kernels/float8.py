"""FP8 (e4m3) grouped GEMMs with rowwise scales, for the routed experts, forward and backward; the dense linears
(`float8_linear`) are their one-group case. Also the 1x128 blockwise quantization of DeepEP's FP8 dispatch.

Every GEMM quantizes its two operands along their reduction dimension, so each scale factors out of the dot products
and is applied to the fp32 result:

    forward     out[m]    = x[m] W_e^T              x: one scale per row,     W_e: one per output row (over K)
    grad input  dx[m]     = (dout[m] * s_e) Wq_e    dout * s_e: one per row,  Wq_e: the forward's FP8 W_e
    grad weight dW_e      = dout_e^T x_e            dout, x: one per column *within each expert's rows*

W_e's scales s_e vary along the grad-input GEMM's reduction (N), so they multiply dout's columns before dout is
quantized and the forward's FP8 weights serve again, transposed (cheaper than re-quantizing the bf16 weights).
Otherwise this is torchao's rowwise float8 MoE recipe, fast (no fp32 promotion) accumulation included: the precise
kernel runs at half bf16's speed on groups under 2,048 rows, for an error close to the fast one's on sums of random
sign. The dense linears accumulate fast only in the forward, as torchao's Float8Linear does. On CUDA the GEMMs are
`torch._scaled_grouped_mm` and the quantization runs in Triton (float8_kernels.py); elsewhere the same quantized
operands are multiplied in bf16/fp32 (exact: FP8 values are bf16 values), so CPU tests see the same rounding.

Rows past the last group end belong to no group: left out of every scale, their outputs unspecified.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "FP8_DTYPE",
    "WIRE_BLOCK",
    "Float8WeightCache",
    "Float8Weights",
    "check_float8_supported",
    "dequantize",
    "dequantize_blockwise",
    "float8_grouped_mm",
    "float8_linear",
    "quantize_blockwise",
    "quantize_columns_per_group",
    "quantize_rowwise",
    "quantize_rowwise_group_scaled",
    "quantize_weights",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
_EPS = 1e-12  # all-zero rows get a finite scale
ROWS_PER_BLOCK = 16
WIRE_BLOCK = 128  # channels per scale of FP8 tokens on the wire (DeepEP's FP8 dispatch, DeepSeek-V3's 1x128 tiles)


def quantize_rowwise(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """t -> (fp8 tensor, fp32 scales) with t ~ fp8 * scale, one scale per slice along `dim` (dim removed)."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp_min(_EPS)
    quantized = (t.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, (amax / FP8_MAX).squeeze(dim)


def quantize_blockwise(t: torch.Tensor, block: int = WIRE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C), C a multiple of `block` -> (fp8 (M, C), fp32 scales (M, C / block)): one scale per `block`
    consecutive channels of a row, the layout DeepEP's FP8 dispatch carries (`x_scales`)."""
    rows, cols = t.shape
    if cols % block:
        raise ValueError(
            f"FP8 dispatch sends one scale per {block} channels, but the hidden size is {cols}; drop "
            "--deepep.float8_dispatch"
        )
    quantized, scale = quantize_rowwise(t.reshape(rows, cols // block, block))
    return quantized.view(rows, cols), scale


def dequantize_blockwise(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_blockwise` (fp32)."""
    rows, cols = quantized.shape
    return dequantize(quantized.view(rows, scale.shape[1], cols // scale.shape[1]), scale).view(rows, cols)


def quantize_rowwise_group_scaled(
    t: torch.Tensor, col_scale: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C) in groups of rows ending at offsets (G,): each row times its group's column scales (G, C), then
    `quantize_rowwise`. Rows past the last end take the last group's scales."""
    return quantize_rowwise(t.float() * _scale_of_row(col_scale.float(), offsets, t.shape[0]))


def quantize_columns_per_group(t: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C) -> (fp8 t^T (C, M) contiguous, scales (G, C)): one scale per column within each group of rows, the
    layout the weight-gradient GEMM reads. offsets: the G cumulative group ends, multiples of `ROWS_PER_BLOCK` like M,
    so the per-group maximum is a maximum over per-block maxima. Rows past the last end are zeroed and left out."""
    num_rows, num_cols = t.shape
    num_groups = offsets.shape[0]
    group_of_row = _group_of_row(offsets, num_rows)  # (M,), G for rows past the last end
    block_amax = t.detach().abs().float().view(num_rows // ROWS_PER_BLOCK, ROWS_PER_BLOCK, num_cols).amax(1)
    group_of_block = group_of_row[::ROWS_PER_BLOCK, None].expand(block_amax.shape)
    amax = block_amax.new_zeros(num_groups + 1, num_cols).scatter_reduce(0, group_of_block, block_amax, "amax")
    amax = amax[:num_groups].clamp_min(_EPS)
    inverse = torch.cat([FP8_MAX / amax, amax.new_zeros(1, num_cols)])[group_of_row]  # padding rows -> 0
    in_group = (group_of_row < num_groups)[:, None]  # zero them whatever they hold (even NaN)
    quantized = torch.where(in_group, t.float() * inverse, 0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.t().contiguous(), amax / FP8_MAX


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The inverse of `quantize_rowwise` (fp32)."""
    return quantized.float() * scale.unsqueeze(dim)


class Float8Weights(NamedTuple):
    """Weights (E, N, K) (a pair stacked along N) in FP8: `values` row-major with `scales` (E, N) for the forward,
    and the same values column-major (`transposed`, strides (N K, 1, N)) for the grad-input GEMM."""

    values: torch.Tensor
    scales: torch.Tensor
    transposed: torch.Tensor


def quantize_weights(weights: Sequence[torch.Tensor]) -> Float8Weights:
    """`Float8Weights` of weights (E, N_i, K) stacked along N (no autograd: the GEMMs' weight gradients go to the
    weights themselves)."""
    with torch.no_grad():
        values, scales = _rowwise_stacked(list(weights))
        if values.is_cuda:
            from torchtitan.kernels.float8_kernels import transpose_slabs_cuda

            return Float8Weights(values, scales, transpose_slabs_cuda(values).transpose(-2, -1))
        return Float8Weights(values, scales, _column_major(values))


class Float8WeightCache:
    """The FP8 copies of some weights, quantized again only when a weight changed (its version counter moved, which
    `MultiTensorAdamW` also bumps, or it holds other storage): once per optimizer step instead of once per use.

    Only for weights that stay in place between steps: FSDP gathers them anew into reused storage without a version
    change, so FSDP-wrapped modules quantize at every use instead."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self._weights: Float8Weights | None = None

    def get(self, weights: Sequence[torch.Tensor]) -> Float8Weights:
        if torch.is_inference_mode_enabled():  # inference tensors could not be saved for a later training backward
            return quantize_weights(weights)
        key = tuple((w._version, w.data_ptr()) for w in weights)
        if key != self._key or self._weights is None:
            self._weights = quantize_weights(weights)
            self._key = key
        return self._weights


def float8_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor | Sequence[torch.Tensor],
    offsets: torch.Tensor,
    w_float8: Float8Weights | None = None,
) -> torch.Tensor:
    """x (M, K) @ w[g] (E, N, K) transposed for the rows of each group g -> (M, N) bf16, in FP8 both ways.

    w may be a pair (E, N_i, K) sharing x (the experts' gate and up projections): one GEMM against them stacked along N,
    x quantized once each way. offsets: (E,) int32 cumulative group ends (`torch._grouped_mm`'s); with M, multiples of
    16. w_float8: w already quantized (`quantize_weights`, e.g. from a `Float8WeightCache`); else quantized here.
    """
    w, w_stacked = (w, None) if isinstance(w, torch.Tensor) else w
    return _Float8GroupedMM.apply(x, offsets, w, w_stacked, *(w_float8 or (None, None, None)))


def float8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) in FP8 both ways, the same recipe as the experts': the one-group case of
    `float8_grouped_mm` (on CUDA the GEMMs are then cuBLAS's `torch._scaled_mm`). x (..., K), weight (N, K); the
    rows of x (its leading dims' product) and N, K must be multiples of 16."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] % ROWS_PER_BLOCK:
        raise ValueError(
            f"FP8 linears need the token rows (batch x sequence) in blocks of {ROWS_PER_BLOCK}, got {rows.shape[0]}; "
            "use a seq_len that is a multiple of 16 or drop --quantize.float8_linears"
        )
    offsets = torch.full((1,), rows.shape[0], dtype=torch.int32, device=x.device)
    out = _Float8GroupedMM.apply(rows, offsets, weight.unsqueeze(0), None, None, None, None)
    return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


class _Float8GroupedMM(torch.autograd.Function):
    """x @ w^T, or x @ [w; w_stacked]^T when w_stacked is given; w_q, w_scale, w_q_t: their `Float8Weights` when
    quantized already (fixed arguments: dynamo mis-traced a variable number of weights)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        offsets: torch.Tensor,
        w: torch.Tensor,
        w_stacked: torch.Tensor | None,
        w_q: torch.Tensor | None,
        w_scale: torch.Tensor | None,
        w_q_t: torch.Tensor | None,
    ) -> torch.Tensor:
        weights = [w] if w_stacked is None else [w, w_stacked]
        x_q, x_scale = _rowwise(x)  # (M, K), (M,)
        if w_q is None:
            w_q, w_scale = _rowwise_stacked(weights)  # (E, N, K), (E, N) with N = sum N_i
        ctx.save_for_backward(x, offsets, w_q, w_scale, w_q_t)
        ctx.rows = [weight.shape[1] for weight in weights]
        ctx.dtypes = [weight.dtype for weight in weights]
        return _scaled_grouped_mm(x_q, w_q.transpose(-2, -1), x_scale, w_scale, offsets, forward=True)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offsets, w_q, w_scale, w_q_t = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            # the module docstring's grad input: grad_out * s_e quantized by rows, W_e's FP8 values column-major
            g_q, g_scale = _rowwise_group_scaled(grad_out, w_scale, offsets)  # (M, N), (M,)
            if w_q_t is None:
                w_q_t = _column_major(w_q)
            no_scale = w_scale.new_ones(w_q.shape[0], w_q.shape[2])  # (E, K)
            grad_x = _scaled_grouped_mm(g_q, w_q_t, g_scale, no_scale, offsets, forward=False).to(x.dtype)
        grad_ws = [None, None]
        if any(ctx.needs_input_grad[2:]):
            gt_q, g_scale, xt_q, x_scale = _grad_weight_operands(grad_out, x, offsets)  # (N, M), (E, N), (K, M), (E, K)
            start = 0
            for i, (n, dtype) in enumerate(zip(ctx.rows, ctx.dtypes, strict=True)):
                # row-major (N_i, M) and column-major (M, K) operands, reduced over each group's rows
                rows = slice(start, start + n)
                grad_w = _scaled_grouped_mm(gt_q[rows], xt_q.t(), g_scale[:, rows], x_scale, offsets, forward=False)
                grad_ws[i] = grad_w.to(dtype)
                start += n
        return grad_x, None, *grad_ws, None, None, None


def _column_major(w_q: torch.Tensor) -> torch.Tensor:
    """(E, N, K) -> the same values (E, N, K) stored column-major (as (E, K, N) contiguous)."""
    return w_q.transpose(-2, -1).contiguous().transpose(-2, -1)


# The quantization as custom ops: CUDA runs the Triton kernels of float8_kernels.py (one pass per operand), other
# devices the torch versions above. Opaque to torch.compile with explicit fake kernels: traced into, the Triton
# launches specialized the dynamic row count and the compiled backward asserted a stale stride.


@torch.library.custom_op("torchtitan::fp8_quantize_rowwise", mutates_args=())
def _rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (..., C) -> (fp8 (..., C) contiguous, scales (...)), as `quantize_rowwise`."""
    if t.is_cuda and t.shape[-1] <= 16384:
        from torchtitan.kernels.float8_kernels import quantize_rowwise_cuda

        return quantize_rowwise_cuda(t.contiguous())
    quantized, scale = quantize_rowwise(t)
    return quantized.contiguous(), scale.contiguous()


@_rowwise.register_fake
def _(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.new_empty(t.shape, dtype=FP8_DTYPE), t.new_empty(t.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchtitan::fp8_quantize_rowwise_stacked", mutates_args=())
def _rowwise_stacked(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (E, N_i, K) -> (fp8 (E, sum N_i, K), scales (E, sum N_i)): `quantize_rowwise` of the weights stacked
    along N per expert, written in place on CUDA (no bf16 copy of the stack)."""
    if weights[0].is_cuda and weights[0].shape[-1] <= 16384:
        from torchtitan.kernels.float8_kernels import quantize_rowwise_stacked_cuda

        return quantize_rowwise_stacked_cuda([w.contiguous() for w in weights])
    quantized, scale = quantize_rowwise(torch.cat(list(weights), dim=1))
    return quantized.contiguous(), scale.contiguous()


@_rowwise_stacked.register_fake
def _(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    (num_experts, _, k), rows = weights[0].shape, sum(w.shape[1] for w in weights)
    w = weights[0]
    return w.new_empty((num_experts, rows, k), dtype=FP8_DTYPE), w.new_empty((num_experts, rows), dtype=torch.float32)


@torch.library.custom_op("torchtitan::fp8_quantize_rowwise_group_scaled", mutates_args=())
def _rowwise_group_scaled(
    t: torch.Tensor, col_scale: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """t (M, C), col_scale (G, C), offsets (G,) -> (fp8 (M, C), scales (M,)), as `quantize_rowwise_group_scaled`."""
    if t.is_cuda and t.shape[-1] <= 16384:
        from torchtitan.kernels.float8_kernels import quantize_rowwise_cuda

        return quantize_rowwise_cuda(t.contiguous(), col_scale, offsets)
    quantized, scale = quantize_rowwise_group_scaled(t, col_scale, offsets)
    return quantized.contiguous(), scale.contiguous()


@_rowwise_group_scaled.register_fake
def _(t: torch.Tensor, col_scale: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.new_empty(t.shape, dtype=FP8_DTYPE), t.new_empty(t.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchtitan::fp8_quantize_grad_weight_operands", mutates_args=())
def _grad_weight_operands(
    grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both operands of the weight-gradient GEMM: `quantize_columns_per_group` of grad_out (M, N) and of x (M, K)
    -> (fp8 (N, M), scales (G, N), fp8 (K, M), scales (G, K)).

    One op so compile cannot move x's quantization into the forward and save x^T's column-major view, whose stride
    is the dynamic row count (the compiled backward asserted a stale stride). Saved activations stay row-major."""
    if grad_out.is_cuda:
        from torchtitan.kernels.float8_kernels import quantize_columns_per_group_cuda as quantize
    else:
        quantize = quantize_columns_per_group
    return (*quantize(grad_out.contiguous(), offsets), *quantize(x.contiguous(), offsets))


@_grad_weight_operands.register_fake
def _(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor):
    def operand(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = t.new_empty((offsets.shape[0], t.shape[1]), dtype=torch.float32)
        return t.new_empty((t.shape[1], x.shape[0]), dtype=FP8_DTYPE), scales

    return (*operand(grad_out), *operand(x))


def _scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offsets: torch.Tensor, forward: bool
) -> torch.Tensor:
    """Two forms, as torch._scaled_grouped_mm: a (M, K) 2D x b (E, K, N) 3D -> (M, N), scale_a (M,), scale_b
    (E, N); or a (N, M) x b (M, K), both 2D, grouped along M -> (E, N, K), scale_a (E, N), scale_b (E, K).
    The accumulation is fast in every grouped GEMM and in a dense linear's forward (module docstring)."""
    if a.is_cuda:
        if offsets.shape[0] == 1:  # a dense linear (`float8_linear`)
            return _scaled_mm_one_group(a, b, scale_a, scale_b, fast_accum=forward)
        if b.dim() == 2:
            scale_a, scale_b = scale_a.flatten(), scale_b.flatten()
        return torch._scaled_grouped_mm(
            a, b, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    return _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offsets)


def _scaled_mm_one_group(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, fast_accum: bool
) -> torch.Tensor:
    """`_scaled_grouped_mm` for one group, by the dense FP8 GEMM (cuBLAS). Rows past the group's end are computed
    (the 3D form leaves them unspecified) or, in the 2D form, zeros in both quantized operands (they add nothing)."""
    grouped_weight = b.dim() == 3
    if grouped_weight:  # (M, K) x (1, K, N) -> (M, N); scales (M,), (1, N)
        b, scale_a = b[0], scale_a[:, None]
    else:  # (N, M) x (M, K) -> (1, N, K); scales (1, N), (1, K)
        scale_a = scale_a[0][:, None]
    out = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out if grouped_weight else out[None]


# An op of its own, opaque like the CUDA kernel, so that compile partitions the CPU graph as it does the CUDA one
# and CPU tests see what the GPU sees (traced into, its bf16 casts changed what the partitioner saved).
@torch.library.custom_op("torchtitan::fp8_scaled_grouped_mm_emulated", mutates_args=())
def _emulated_scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """`torch._scaled_grouped_mm` on any device: FP8 values are exact in bf16, so the GEMM sums exact products in fp32
    and the scales multiply each result, as the kernel does before its one rounding to bf16 (fp32 GEMM on CPU)."""
    dtype = torch.float32 if a.device.type == "cpu" else torch.bfloat16
    product = torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offsets).float()
    if b.dim() == 3:
        return (product * scale_a[:, None] * _scale_of_row(scale_b, offsets, a.shape[0])).to(torch.bfloat16)
    return (product * scale_a[:, :, None] * scale_b[:, None, :]).to(torch.bfloat16)


@_emulated_scaled_grouped_mm.register_fake
def _(a, b, scale_a, scale_b, offsets):
    shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offsets.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(shape, dtype=torch.bfloat16)


def _scale_of_row(scale_b: torch.Tensor, offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(E, N) per-group scales -> (M, N), each row's group's (rows past the last end take the last group's)."""
    return scale_b[_group_of_row(offsets, num_rows).clamp_max(offsets.shape[0] - 1)]


def _group_of_row(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    rows = torch.arange(num_rows, device=offsets.device)
    return torch.searchsorted(offsets.to(torch.int64), rows, right=True)


def check_float8_supported(device: torch.device, flag: str = "--quantize.float8_experts") -> None:
    """FP8 GEMMs need FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); CPU emulates them."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"FP8 GEMMs need FP8 tensor cores (compute capability >= 8.9), but {torch.cuda.get_device_name(device)} "
            f"is {major}.{minor}; drop {flag}"
        )
