"""The arguments of one multi-tensor AdamW step, defined once for its two implementations: the Triton kernel
(`multi_tensor_kernels.adamw_update_`, CUDA) and torch's foreach ops (`components/adamw.py`, other devices)."""

from dataclasses import dataclass

import torch

__all__ = ["AdamWUpdate"]


@dataclass(frozen=True)
class AdamWUpdate:
    """One AdamW step of a bucket of tensors: param = param * decay_factor - step_size * m / (sqrt(v) /
    bias_correction2_sqrt + eps), after updating m and v with grad * grad_scale; step_size (lr / bias_correction1) and
    bias_correction2_sqrt per tensor. low_bits: the params are bf16 and hold fp32 masters with these int16 low bits
    (`master_weights.py`); the update runs on the masters and writes both halves back. rounding_seed: bf16 moments
    round stochastically with random bits drawn from it (a new seed each step)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    step_sizes: list[float]
    bias_correction2_sqrts: list[float]
    decay_factor: float
    beta1: float
    beta2: float
    eps: float
    grad_scale: torch.Tensor | None
    low_bits: list[torch.Tensor] | None = None
    rounding_seed: int = 0
