"""bf16 weights with fp32 master copies: mixed precision for a model that FSDP does not wrap (one device).

FSDP casts its units' parameters to bf16 once per forward. Without it the forward runs under autocast, which casts
every fp32 weight at every use, and activation checkpointing casts again in the recompute: three casts per weight per
micro-batch. Here the weights that compute in bf16 anyway are stored in bf16, so nothing casts them; their fp32
masters are what the optimizer updates, and it writes each master rounded to bf16 back into its weight in the same
pass (`MultiTensorAdamW(master_weights=...)`): one cast per weight per optimizer step. A bf16 weight's gradient is
the bf16 gradient autocast's cast backward produced before it was upcast (for one micro-batch, the same values).
Memory per such weight: bf16 weight + fp32 master + bf16 gradient = fp32 weight + fp32 gradient.

With gradient accumulation the weights' gradients are fp32 (`grad_dtype`): autograd upcasts each micro-batch's bf16
gradient and sums in fp32, as it does for fp32 weights (a bf16 sum would round at every micro-batch). That costs 2
bytes per weight more than fp32 weights do.

The model's state dict holds the masters (same keys, fp32), and loading a state dict sets the master and its bf16
weight: checkpoints, exports and initial loads see the fp32 values, and stay interchangeable with fp32 models.
"""

from functools import partial
from typing import Any

import torch
from torch import nn

__all__ = ["store_weights_in_bf16"]


def store_weights_in_bf16(
    model_parts: list[nn.Module], module_types: tuple[type[nn.Module], ...], fp32_grads: bool
) -> dict[nn.Parameter, torch.Tensor]:
    """Store the parameters of every module of `module_types` in bf16, after their fp32 initialization; returns
    {parameter: its fp32 master} (the fp32 tensor the parameter held). fp32_grads: gradients accumulate in fp32
    (gradient accumulation)."""
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


def _masters_in_state_dict(
    masters: dict[str, torch.Tensor], module: nn.Module, state_dict: dict, prefix: str, *_
) -> None:
    for name, master in masters.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = master


def _load_into_masters(
    masters: dict[str, torch.Tensor], module: nn.Module, state_dict: dict, prefix: str, *_: Any
) -> None:
    """Before the module copies each value into its bf16 parameter (rounding it), the master takes it whole."""
    for name, master in masters.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value is not master and value.shape == master.shape:
            with torch.no_grad():
                master.copy_(value)
