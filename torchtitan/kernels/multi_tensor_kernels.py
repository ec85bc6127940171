"""Triton kernels over many tensors in one launch: the AdamW update and the sum of squares (CUDA only).

torch's multi_tensor_apply launches at most 320 blocks and splits launches by tensor count, far from the memory
bound on a few hundred large tensors. Here one launch covers a whole list: program i finds its (tensor, chunk) in
`multi_tensor.py`'s chunk table and the tensor's address in an int64 table.

Vectorized (16-byte) accesses need known alignment: chunk starts are multiples of CHUNK, addresses are declared
aligned when the host checked (ALIGNED), and full chunks run unmasked.

Arithmetic is fp32 with IEEE-rounded division and square root (`div_rn`, `sqrt_rn`), in the order of torch's fused
AdamW kernel; bf16 moments are read into fp32 and rounded stochastically when stored (`_round_to_bf16_stochastically`).
"""

import torch
import triton
import triton.language as tl

from torchtitan.kernels.adamw_update import AdamWUpdate
from torchtitan.kernels.chunk_table import CHUNK, chunk_table, to_device_tables

__all__ = ["adamw_update_", "sum_of_squares"]

# Elements per loop iteration of a program, and its warps (4 elements per thread): 8 warps ran the update faster
# than 4 on an H200 (benchmarks/NOTES.md).
_BLOCK = 1024
_NUM_WARPS = 8
_GRAD_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit(do_not_specialize=["rounding_seed"])  # a new seed each step must not compile a new kernel
def _adamw_kernel(
    addresses_ptr,  # (4 or 5, num_tensors) int64: param, grad, exp_avg, exp_avg_sq[, low bits of the masters]
    scalars_ptr,  # (2, num_tensors) fp32: lr / bias_correction1, sqrt(bias_correction2)
    numels_ptr,
    tensor_of_chunk_ptr,
    chunk_in_tensor_ptr,
    grad_scale_ptr,  # (1,) fp32, read when HAS_GRAD_SCALE
    num_tensors,
    decay_factor,  # 1 - lr * weight_decay
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    rounding_seed,  # int32: bf16 moments' stochastic rounding draws Philox(rounding_seed + tensor, element offset)
    HAS_GRAD_SCALE: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    MOMENTS_BF16: tl.constexpr,
    SPLIT_MASTERS: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(tensor_of_chunk_ptr + chunk)
    start = tl.load(chunk_in_tensor_ptr + chunk).to(tl.int64) * CHUNK
    numel = tl.load(numels_ptr + tensor)
    if SPLIT_MASTERS:  # bf16 params (read as their bits) and the table's fifth row, their masters' low bits
        param_ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(tl.int16))
        low_ptr = tl.load(addresses_ptr + 4 * num_tensors + tensor).to(tl.pointer_type(tl.int16))
    else:
        param_ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(tl.float32))
        low_ptr = addresses_ptr  # never read
    moment_type = tl.pointer_type(tl.bfloat16 if MOMENTS_BF16 else tl.float32)
    exp_avg_ptr = tl.load(addresses_ptr + 2 * num_tensors + tensor).to(moment_type)
    exp_avg_sq_ptr = tl.load(addresses_ptr + 3 * num_tensors + tensor).to(moment_type)
    grad_type = tl.pointer_type(tl.bfloat16 if GRAD_BF16 else tl.float32)
    grad_ptr = tl.load(addresses_ptr + num_tensors + tensor).to(grad_type)
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
        exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
        low_ptr = tl.multiple_of(low_ptr, 16)
    step_size = tl.load(scalars_ptr + tensor)
    bias_correction2_sqrt = tl.load(scalars_ptr + num_tensors + tensor)
    grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0

    if start + CHUNK <= numel:
        for offset in range(0, CHUNK, BLOCK):
            _adamw_block(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, low_ptr, start + offset + tl.arange(0, BLOCK),
                numel, grad_scale, step_size, bias_correction2_sqrt, decay_factor, beta1, one_minus_beta1, beta2,
                one_minus_beta2, eps, rounding_seed + tensor, SPLIT_MASTERS=SPLIT_MASTERS, MOMENTS_BF16=MOMENTS_BF16,
                MASKED=False,
            )  # fmt: skip
    else:
        for offset in range(0, CHUNK, BLOCK):
            _adamw_block(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, low_ptr, start + offset + tl.arange(0, BLOCK),
                numel, grad_scale, step_size, bias_correction2_sqrt, decay_factor, beta1, one_minus_beta1, beta2,
                one_minus_beta2, eps, rounding_seed + tensor, SPLIT_MASTERS=SPLIT_MASTERS, MOMENTS_BF16=MOMENTS_BF16,
                MASKED=True,
            )  # fmt: skip


@triton.jit
def _adamw_block(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    low_ptr,
    offsets,
    numel,
    grad_scale,
    step_size,
    bias_correction2_sqrt,
    decay_factor,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    rounding_seed,
    SPLIT_MASTERS: tl.constexpr,
    MOMENTS_BF16: tl.constexpr,
    MASKED: tl.constexpr,
):
    mask = offsets < numel if MASKED else None  # full chunks load and store unmasked (vectorized)
    other = 0 if MASKED else None
    if SPLIT_MASTERS:
        weight_bits = tl.load(param_ptr + offsets, mask=mask, other=other)
        param = _join_fp32(weight_bits, tl.load(low_ptr + offsets, mask=mask, other=other))
    else:
        param = tl.load(param_ptr + offsets, mask=mask, other=other)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=other).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=other).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=other).to(tl.float32)

    grad = grad * grad_scale  # the clip coefficient: the gradient in memory stays unclipped
    param = param * decay_factor
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.math.div_rn(tl.math.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.math.div_rn(step_size * exp_avg, denom)

    if SPLIT_MASTERS:
        weight_bits, low_bits = _split_fp32(param)
    if MOMENTS_BF16:
        # 32-bit Philox (uint32 draws); offsets past 2^31 in one tensor repeat draws, which biases nothing
        random_avg, random_avg_sq, _, _ = tl.randint4x(rounding_seed, offsets.to(tl.int32))
        exp_avg = _round_to_bf16_stochastically(exp_avg, random_avg)
        exp_avg_sq = _round_to_bf16_stochastically(exp_avg_sq, random_avg_sq)
    if SPLIT_MASTERS:
        tl.store(param_ptr + offsets, weight_bits, mask=mask)
        tl.store(low_ptr + offsets, low_bits, mask=mask)
    else:
        tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)


@triton.jit
def _round_to_bf16_stochastically(value, random):
    """bf16 `value` rounded up in magnitude with probability (its dropped 16 bits) / 2^16: unbiased, so an EMA whose
    increment is below half a bf16 ulp still moves (`adamw._round_to_bf16_stochastically`)."""
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + (random & 0xFFFF).to(tl.uint32)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero


@triton.jit
def _join_fp32(weight_bits, low_bits):
    """A master from its bf16 weight's bits and its low bits, both int16 (`master_weights.join_fp32`)."""
    low = low_bits.to(tl.int32) & 0xFFFF
    upper = (weight_bits.to(tl.int32) & 0xFFFF) - (low >= 0x8000).to(tl.int32)
    return ((upper << 16) | low).to(tl.float32, bitcast=True)


@triton.jit
def _split_fp32(master):
    """(bf16 weight bits: nearest, ties away from zero; low bits), both int16 (`master_weights.split_fp32`)."""
    bits = master.to(tl.int32, bitcast=True)
    low = bits & 0xFFFF
    upper = ((bits >> 16) & 0xFFFF) + (low >= 0x8000).to(tl.int32)
    return upper.to(tl.int16), low.to(tl.int16)


@triton.jit
def _sum_of_squares_kernel(
    addresses_ptr,  # (num_tensors,) int64
    numels_ptr,
    tensor_of_chunk_ptr,
    chunk_in_tensor_ptr,
    partial_sums_ptr,  # (num_chunks,) fp32, one per program
    BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(tensor_of_chunk_ptr + chunk)
    start = tl.load(chunk_in_tensor_ptr + chunk).to(tl.int64) * CHUNK
    numel = tl.load(numels_ptr + tensor)
    ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(tl.bfloat16 if BF16 else tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    if start + CHUNK <= numel:
        for offset in range(0, CHUNK, BLOCK):
            x = tl.load(ptr + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
            total += x * x
    else:
        for offset in range(0, CHUNK, BLOCK):
            offsets = start + offset + tl.arange(0, BLOCK)
            x = tl.load(ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
            total += x * x
    tl.store(partial_sums_ptr + chunk, tl.sum(total, axis=0))


def adamw_update_(update: AdamWUpdate) -> None:
    """The update in one launch: fp32 params (or bf16 ones with low_bits), fp32 or bf16 moments and gradients, all
    contiguous."""
    params, low_bits, grad_scale = update.params, update.low_bits, update.grad_scale
    tables = (params, update.grads, update.exp_avgs, update.exp_avg_sqs) + ((low_bits,) if low_bits is not None else ())
    _check_tensors(*tables)
    device = params[0].device
    table = chunk_table(tuple(p.numel() for p in params), device)
    if table.num_chunks == 0:
        return
    addresses = [t.data_ptr() for tensors in tables for t in tensors]
    scalars = torch.tensor([*update.step_sizes, *update.bias_correction2_sqrts], dtype=torch.float32)
    addresses_on_device, scalars_on_device = to_device_tables(addresses, scalars, device)
    beta1, beta2 = update.beta1, update.beta2
    _adamw_kernel[(table.num_chunks,)](
        addresses_on_device,
        scalars_on_device,
        table.numels,
        table.tensor_of_chunk,
        table.chunk_in_tensor,
        scalars_on_device if grad_scale is None else grad_scale,
        len(params),
        update.decay_factor,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        update.eps,
        update.rounding_seed,
        HAS_GRAD_SCALE=grad_scale is not None,
        GRAD_BF16=update.grads[0].dtype == torch.bfloat16,
        MOMENTS_BF16=update.exp_avgs[0].dtype == torch.bfloat16,
        SPLIT_MASTERS=low_bits is not None,
        ALIGNED=all(address % 16 == 0 for address in addresses),
        CHUNK=CHUNK,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )
    # written behind autograd's back: their version counters say so (caches of the weights, e.g. the FP8 experts'
    # quantized copies, and saved-tensor checks read them)
    torch.autograd.graph.increment_version([*params, *(low_bits or [])])


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum_i ||t_i||^2 as a 0-dim fp32 tensor: one launch per dtype writes per-chunk partial sums, one torch sum."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.dtype not in _GRAD_DTYPES or not tensor.is_contiguous():
            raise ValueError(
                f"the Triton sum of squares takes contiguous {_GRAD_DTYPES} tensors, got {tensor.dtype} "
                f"(contiguous={tensor.is_contiguous()}): set --optimizer.implementation foreach"
            )
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    device = tensors[0].device
    partial_sums = []
    for dtype, group in by_dtype.items():
        table = chunk_table(tuple(t.numel() for t in group), device)
        if table.num_chunks == 0:
            continue
        addresses = [t.data_ptr() for t in group]
        addresses_on_device, _ = to_device_tables(addresses, torch.empty(0), device)
        partial = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
        _sum_of_squares_kernel[(table.num_chunks,)](
            addresses_on_device,
            table.numels,
            table.tensor_of_chunk,
            table.chunk_in_tensor,
            partial,
            BF16=dtype == torch.bfloat16,
            ALIGNED=all(address % 16 == 0 for address in addresses),
            CHUNK=CHUNK,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
        partial_sums.append(partial)
    if not partial_sums:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.cat(partial_sums).sum() if len(partial_sums) > 1 else partial_sums[0].sum()


def _check_tensors(params: list[torch.Tensor], grads: list[torch.Tensor], *others: list[torch.Tensor]) -> None:
    """The kernel reads flat memory: every tensor contiguous, one gradient dtype, one moments dtype (fp32 or bf16),
    and fp32 params or bf16 params with int16 low bits (a fifth list)."""
    split = len(others) > 2
    param_dtype, low_dtypes = (torch.bfloat16, {torch.int16}) if split else (torch.float32, set())
    moment_dtypes = {moment.dtype for moments in others[:2] for moment in moments}
    if (
        any(param.dtype != param_dtype for param in params)
        or grads[0].dtype not in _GRAD_DTYPES
        or len(moment_dtypes) > 1
        or not moment_dtypes <= set(_GRAD_DTYPES)
        or (split and {low.dtype for low in others[2]} != low_dtypes)
    ):
        raise ValueError(
            f"the Triton AdamW takes float32 parameters (or bf16 ones with the int16 low bits of their masters), "
            f"{_GRAD_DTYPES} gradients and moments of one of those, got {params[0].dtype}, {grads[0].dtype} and "
            f"{sorted(map(str, moment_dtypes))}: keep fp32 master weights, or set --optimizer.implementation foreach"
        )
    for tensors in (params, grads, *others):
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError(
                    f"the Triton AdamW needs contiguous parameters, gradients and moments; got a {tensor.dtype} "
                    f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()}: set "
                    "--optimizer.implementation foreach"
                )
