"""The output head, optionally fused with the cross-entropy: logits and their gradient in row chunks.

The plain head's (tokens, vocab) logits and their gradient were the allocated peak of a 16B step (6.25 GiB).
Called with labels, `OutputHead` walks the rows in chunks: each chunk's logits give its share of the loss sum and
the gradient of the logits, folded into the gradients of the hidden states and the weight before the next chunk;
backward only scales them by the incoming gradient. Same GEMMs, no recompute, one chunk of logits at a time. The
weight gradient accumulates in fp32 over chunks (the plain head rounds it once in bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["OutputHead", "chunk_loss_and_grad"]

DEFAULT_CHUNK_ROWS = 2048
"""Rows per chunk: 2048 x 102,400 logits are 0.4 GiB in bf16; the GEMMs stay large (M = 2048)."""

ChunkFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: the fp32 sum of cross entropy over labels != IGNORE_INDEX, and d(sum)/d(logits) in the logits'
    dtype (softmax minus one-hot, zero on ignored rows). Written as one reduction and one elementwise expression
    (the one-hot as a comparison, no scatter) so torch.compile makes two passes over the logits."""
    logits32 = logits.float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(logits32, dim=-1, keepdim=True)
    loss = torch.where(valid, (lse - logits32.gather(1, target)).squeeze(1), 0.0).sum()
    one_hot = torch.arange(logits.shape[-1], device=logits.device) == target
    grad = (torch.exp(logits32 - lse) - one_hot.float()) * valid.unsqueeze(1)
    return loss, grad.to(logits.dtype)


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_rows: int, chunk_fn: ChunkFn, compute_dtype: torch.dtype):
        w = weight.to(compute_dtype)
        grad_h = torch.empty(h.shape, dtype=compute_dtype, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h_chunk = h[rows].to(compute_dtype)
            loss, grad_logits = chunk_fn(torch.mm(h_chunk, w.t()), labels[rows])
            total += loss
            torch.mm(grad_logits, w, out=grad_h[rows])
            if grad_w is not None and grad_w.is_cuda:  # the GEMM adds into the fp32 sum (cuBLAS, fp32 C)
                torch.addmm(grad_w, grad_logits.t(), h_chunk, out_dtype=torch.float32, out=grad_w)
            elif grad_w is not None:
                grad_w += torch.mm(grad_logits.t(), h_chunk)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        grad_h = (grad_h * grad_total).to(h_dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_w * grad_total).to(w_dtype) if grad_w is not None and ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    chunk_fn: ChunkFn = chunk_loss_and_grad,
) -> torch.Tensor:
    """sum over valid labels of cross_entropy(h @ weight.T, labels), fp32, without the full logits.

    h: (..., dim); weight: (vocab, dim); labels: (...) int. The GEMMs run in the autocast dtype when autocast is on
    (as nn.Linear would), else in the weight's dtype.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = weight.dtype
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropySum.apply(
            h.flatten(0, -2), weight, labels.flatten(), chunk_rows, chunk_fn, compute_dtype
        )


class OutputHead(nn.Linear):
    """nn.Linear(dim, vocab, bias=False) (state dict `weight`, FSDP and TP plans unchanged); called with labels it
    returns the cross-entropy token sum from `linear_cross_entropy_sum` instead of logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.chunk_rows = DEFAULT_CHUNK_ROWS
        self.chunk_fn: ChunkFn = chunk_loss_and_grad
        """Set to a torch.compile'd `chunk_loss_and_grad` by the trainer when it compiles the loss."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return F.linear(h, self.weight)
        return linear_cross_entropy_sum(h, self.weight, labels, self.chunk_rows, self.chunk_fn)
