"""The multi-tensor sum of squares (gradient clipping), and the loader of the Triton multi-tensor kernels: CUDA
tensors use `multi_tensor_kernels.py`, imported on first use (importing this module never needs triton); other
devices use torch ops.
"""

from types import ModuleType

import torch

__all__ = ["cuda_kernels", "sum_of_squares"]


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum_i ||t_i||^2 in fp32, a 0-dim tensor on the tensors' (one) device: one Triton launch per dtype on CUDA
    (per-chunk partial sums, then one torch sum), `torch._foreach_norm` elsewhere."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    if tensors[0].device.type == "cuda":
        return cuda_kernels().sum_of_squares(tensors)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)  # a bf16 tensor's norm is not rounded to bf16
    return torch.stack(norms).square().sum()


def cuda_kernels() -> ModuleType:
    """The Triton kernels; a clear error where triton is missing."""
    try:
        from torchtitan.kernels import multi_tensor_kernels
    except ImportError as err:
        raise ImportError(
            f"CUDA parameters are stepped by Triton kernels (optimizer.implementation 'triton') and importing them "
            f"failed ({err}): install triton, or set --optimizer.implementation foreach"
        ) from err
    return multi_tensor_kernels
