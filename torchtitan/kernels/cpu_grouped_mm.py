"""`torch._grouped_mm` for bf16 tensors on CPU, computed in fp32 and rounded to bf16 once (as the GPU accumulates).

bf16 GEMMs run ~30x slower than fp32 on CPUs without bf16 matrix instructions. A custom op with its own backward,
because `torch._grouped_mm` only traces with bf16 operands; per-op SAC saves its output like `aten._grouped_mm`'s.
"""

import torch

__all__ = ["cpu_grouped_mm"]


@torch.library.custom_op("torchtitan::cpu_grouped_mm", mutates_args=())
def cpu_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """As `torch._grouped_mm(a, b, offs=offsets)` for bf16 a and b: a (M, K) x b (E, K, N) -> (M, N), or a (K, M) x
    b (M, N) -> (E, K, N) with the groups along M."""
    return torch._grouped_mm(a.float(), b.float(), offs=offsets).bfloat16()


@cpu_grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offsets.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(shape)


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Only the 3D-weight form (the experts' forward) is differentiated: grad_a = grad x b^T per group, grad_b[g] =
    a^T grad over group g's rows."""
    a, b, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # CPU grouped GEMMs reject stride-0 (expanded) gradients
    return cpu_grouped_mm(grad, b.transpose(-2, -1), offsets), cpu_grouped_mm(a.t(), grad, offsets), None


cpu_grouped_mm.register_autograd(_backward, setup_context=_setup_context)
