"""bf16 weights with fp32 masters: mixed precision for a model FSDP does not wrap (one device).

Under autocast every fp32 weight is cast at each use, and again in activation checkpointing's recompute. The weights
that compute in bf16 anyway are stored in bf16 instead; the optimizer updates their fp32 masters and writes each
rounded to bf16 into its weight in the same pass (`MultiTensorAdamW(master_weights=...)`): one cast per weight per
step. A weight's bf16 gradient is the one autocast's cast backward computed before upcasting it. Memory per weight is
unchanged (bf16 weight + fp32 master + bf16 gradient), except with gradient accumulation: the gradients are then fp32
(`grad_dtype`), summed as for fp32 weights (a bf16 sum rounds at each micro-batch), 2 bytes per weight more.

The model's state dict holds the masters (same keys, fp32) and a loaded value goes to the master before its bf16
copy, so checkpoints, exports and initial loads see fp32 values, interchangeable with an fp32 model's.
"""

from functools import partial
from typing import Any

import torch
from torch import nn

__all__ = ["store_weights_in_bf16"]


def store_weights_in_bf16(
    model_parts: list[nn.Module], module_types: tuple[type[nn.Module], ...], fp32_grads: bool
) -> dict[nn.Parameter, torch.Tensor]:
    """Store the parameters of the modules of `module_types` in bf16 (after their fp32 init); returns {parameter:
    its fp32 master}, the tensor it held. fp32_grads: their gradients are fp32 (gradient accumulation)."""
    masters: dict[nn.Parameter, torch.Tensor] = {}
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, module_types):
                continue
            own = {}
            for name, param in module.named_parameters(recurse=False):
                if param not in masters:  # else shared with a module seen before
                    masters[param] = param.data
                    param.data = param.data.to(torch.bfloat16)
                    if fp32_grads:
                        param.grad_dtype = torch.float32
                own[name] = masters[param]
            module.register_state_dict_post_hook(partial(_masters_in_state_dict, own))
            module.register_load_state_dict_pre_hook(partial(_load_into_masters, own))
    return masters


def _masters_in_state_dict(masters: dict[str, torch.Tensor], module: nn.Module, state_dict: dict, prefix: str, *_: Any):
    for name, master in masters.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = master


def _load_into_masters(masters: dict[str, torch.Tensor], module: nn.Module, state_dict: dict, prefix: str, *_: Any):
    for name, master in masters.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value is not master and value.shape == master.shape:
            with torch.no_grad():
                master.copy_(value)
