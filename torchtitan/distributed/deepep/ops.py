"""`torch.ops.deepep.*`: expert-parallel token dispatch and combine with DeepEP semantics, as custom ops.

    dispatch(x (T, H), topk_idx (T, K) int64, topk_weights (T, K) fp32, num_experts, group_name, sync_free, fp8)
        -> recv_x (N, H)               tokens this rank received, rank-major (source rank, then source order)
           recv_topk_idx (N, K)        local expert ids, -1 where the expert lives on another rank
           recv_topk_weights (N, K)    matching weights, 0 where masked
           num_recv_tokens_per_expert (E_local,) int64
           permuted_slots (M,) int64   flat slots `n * K + k` of the non-masked entries, local-expert-major
           handle: list[Tensor]        the layout; pass it to combine (see handle_layout.py)
    combine(x (N, H), handle, group_name, topk_weights (N, K) | None)
        -> combined_x (T, H)           per source token, the sum of what every rank sent back
           combined_topk_weights (T, K), or (T, 0) when topk_weights is None
    cached_dispatch(x (T, H), handle, group_name) -> (N, H)   dispatch replaying the saved layout

N and M are data dependent (unbacked symbolic sizes in the fake kernels; DeepEP waits on the host for them). With
`sync_free=True` they are the worst case, N = T x EP ranks and M = N x K: rows past sum(num_recv_tokens_per_expert)
hold garbage (recv_topk_idx -1) and callers must ignore them; permuted_slots lists the real copies first.

With `fp8=True` the tokens travel as e4m3 with one fp32 scale per 128 channels (`quantize_blockwise`) and recv_x is
their dequantization in x's dtype; the backward, combine and cached_dispatch stay bf16.

Ops take the EP group's name (process groups cannot be op arguments) and find its buffer in `buffer.py`'s registry.
Dispatch's backward is a combine; combine's backward is a cached dispatch of the saved layout (no host sync). Nothing
is cached across calls: the handle lives as long as autograd or the caller holds it.
"""

from __future__ import annotations

import torch

from torchtitan.distributed.deepep import cpu_kernels, cuda_kernels
from torchtitan.distributed.deepep.buffer import get_buffer

__all__: list[str] = []  # importing it defines torch.ops.deepep.*, what callers use

_LIB = torch.library.Library("deepep", "DEF")
_LIB.define(
    "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, str group_name, bool sync_free, "
    "bool fp8) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])"
)
# No defaults: the dispatcher drops arguments equal to their default, and autograd then expects fewer gradients
# than the backward (written for every argument) returns.
_LIB.define("combine(Tensor x, Tensor[] handle, str group_name, Tensor? topk_weights) -> (Tensor, Tensor)")
_LIB.define("cached_dispatch(Tensor x, Tensor[] handle, str group_name) -> Tensor")


def _kernel(kernels, name: str):
    """`kernels.<name>`, looked up at call time so tests can wrap it (e.g. to count communication calls)."""
    return lambda *args, **kwargs: getattr(kernels, name)(*args, **kwargs)


for _name in ("dispatch", "combine", "cached_dispatch"):
    _LIB.impl(_name, _kernel(cpu_kernels, _name), "CPU")
    _LIB.impl(_name, _kernel(cuda_kernels, _name), "CUDA")


# Fake kernels: shapes only, data-dependent sizes as unbacked symbols.


@torch.library.register_fake("deepep::dispatch", lib=_LIB)
def _dispatch_fake(x, topk_idx, topk_weights, num_experts, group_name, sync_free, fp8):
    buffer = get_buffer(group_name)
    num_tokens, top_k = topk_idx.shape
    if sync_free:
        num_recv = num_tokens * buffer.world_size
        num_copies = num_recv * top_k
    else:
        ctx = torch.library.get_ctx()
        num_recv = ctx.new_dynamic_size()
        num_copies = ctx.new_dynamic_size()
    recv_x = x.new_empty((num_recv, x.shape[1]))
    recv_topk_idx = x.new_empty((num_recv, top_k), dtype=torch.int64)
    recv_topk_weights = x.new_empty((num_recv, top_k), dtype=torch.float32)
    num_recv_tokens_per_expert = x.new_empty((num_experts // buffer.world_size,), dtype=torch.int64)
    slots = x.new_empty((num_copies,), dtype=torch.int64)
    handle = buffer.layout.fake_handle(num_tokens, num_recv, x.device)
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, slots, handle


@torch.library.register_fake("deepep::combine", lib=_LIB)
def _combine_fake(x, handle, group_name, topk_weights=None):
    num_tokens = get_buffer(group_name).layout.num_tokens(handle)
    combined_x = x.new_empty((num_tokens, x.shape[1]))
    top_k = 0 if topk_weights is None else topk_weights.shape[1]
    return combined_x, x.new_empty((num_tokens, top_k), dtype=torch.float32)


@torch.library.register_fake("deepep::cached_dispatch", lib=_LIB)
def _cached_dispatch_fake(x, handle, group_name):
    num_recv = get_buffer(group_name).layout.num_recv(handle)
    return x.new_empty((num_recv, x.shape[1]))


# Autograd.


def _dispatch_setup_context(ctx, inputs, output):
    x, _, topk_weights, _, group_name, _, _ = inputs
    _, recv_topk_idx, _, _, _, handle = output
    ctx.group_name = group_name
    ctx.x_dtype = x.dtype
    ctx.hidden_dim = x.shape[1]
    ctx.weights_dtype = topk_weights.dtype
    ctx.weights_need_grad = topk_weights.requires_grad
    ctx.save_for_backward(recv_topk_idx, *handle)


def _dispatch_backward(ctx, grad_recv_x, _g_idx, grad_recv_topk_weights, _g_counts, _g_slots, _g_handle):
    recv_topk_idx, *handle = ctx.saved_tensors
    if grad_recv_x is None:
        grad_recv_x = recv_topk_idx.new_zeros((recv_topk_idx.shape[0], ctx.hidden_dim), dtype=ctx.x_dtype)
    weights_grad_in = None
    if ctx.weights_need_grad and grad_recv_topk_weights is not None:
        # Only the rank holding an expert owns its weight; masked slots (and sync-free padding) must not add to it.
        weights_grad_in = torch.where(recv_topk_idx >= 0, grad_recv_topk_weights, 0.0).float().contiguous()
    grad_x, grad_topk_weights = torch.ops.deepep.combine(
        grad_recv_x.contiguous(), handle, ctx.group_name, weights_grad_in
    )
    grad_x = grad_x.to(ctx.x_dtype)
    grad_topk_weights = None if weights_grad_in is None else grad_topk_weights.to(ctx.weights_dtype)
    return grad_x, None, grad_topk_weights, None, None, None, None


def _combine_setup_context(ctx, inputs, output):
    x, handle, group_name, topk_weights = inputs
    ctx.group_name = group_name
    ctx.x_dtype = x.dtype
    ctx.weights_need_grad = topk_weights is not None and topk_weights.requires_grad
    ctx.save_for_backward(*handle)


def _combine_backward(ctx, grad_combined_x, grad_combined_topk_weights):
    if ctx.weights_need_grad:
        raise RuntimeError(
            "deepep::combine does not differentiate its topk_weights input (it is only used inside dispatch's "
            "backward); apply routing weights before the combine instead."
        )
    handle = list(ctx.saved_tensors)
    grad_x = torch.ops.deepep.cached_dispatch(grad_combined_x.contiguous(), handle, ctx.group_name)
    return grad_x.to(ctx.x_dtype), [None] * len(handle), None, None


def _cached_dispatch_setup_context(ctx, inputs, output):
    x, handle, group_name = inputs
    ctx.group_name = group_name
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(*handle)


def _cached_dispatch_backward(ctx, grad_recv_x):
    handle = list(ctx.saved_tensors)
    grad_x, _ = torch.ops.deepep.combine(grad_recv_x.contiguous(), handle, ctx.group_name, None)
    return grad_x.to(ctx.x_dtype), [None] * len(handle), None


torch.library.register_autograd("deepep::dispatch", _dispatch_backward, setup_context=_dispatch_setup_context, lib=_LIB)
torch.library.register_autograd("deepep::combine", _combine_backward, setup_context=_combine_setup_context, lib=_LIB)
torch.library.register_autograd(
    "deepep::cached_dispatch", _cached_dispatch_backward, setup_context=_cached_dispatch_setup_context, lib=_LIB
)
