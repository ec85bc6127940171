"""FP8 dense linears (`quantize.float8_linears`): the attention projections and every SwiGLU FFN (the dense
layers' and the shared experts') run their GEMMs in FP8 with rowwise scales, forward and backward, with the
routed experts' recipe (`float8_linear`). The router gate, the output head and the MTP projection stay bf16.

Where FSDP does not gather the weights anew every forward, each weight is quantized once per optimizer step, like
the experts' (`Float8WeightCache`). The linears run inside compiled regions, where a weight's version cannot be
checked, so a forward pre-hook on the model checks them all in eager code and hands each linear its FP8 copy."""

from functools import partial
from typing import Any

import torch
from torch import nn

from torchtitan.kernels.float8 import Float8WeightCache, Float8Weights, float8_linear
from torchtitan.models.deepseek_v3.attention import MLA
from torchtitan.models.moe.feed_forward import FeedForward

__all__ = ["Float8Linear", "convert_to_float8_linears"]


class Float8Linear(nn.Linear):
    """An nn.Linear computed by `float8_linear`; the same parameters and state-dict keys (checkpoints load
    either way). Its input's rows (batch x sequence) must be a multiple of 16."""

    float8_weight: Float8Weights | None = None
    """The weight in FP8 as one group (1, out, in), set before each forward of the model by its weight cache
    (`convert_to_float8_linears(cache_weights=True)`); None: quantized at every use."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = float8_linear(x, self.weight, self.float8_weight)
        return out if self.bias is None else out + self.bias


def convert_to_float8_linears(model: nn.Module, cache_weights: bool = False) -> int:
    """Swap the nn.Linear children of every MLA and FeedForward of `model` for Float8Linear; returns how many.
    Raises naming the fix when a weight's dims are not multiples of 16 (the FP8 GEMMs' alignment).
    cache_weights: quantize each weight once per change of it, checked before every forward of `model` (module
    docstring); not under FSDP."""
    converted = 0
    for parent_name, parent in list(model.named_modules()):
        if not isinstance(parent, MLA | FeedForward):
            continue
        for name, linear in list(parent.named_children()):
            if type(linear) is not nn.Linear:
                continue
            if linear.in_features % 16 or linear.out_features % 16:
                raise ValueError(
                    f"{parent_name}.{name}: FP8 linears need in and out features multiples of 16, got "
                    f"{linear.in_features} -> {linear.out_features}; drop --quantize.float8_linears"
                )
            float8 = Float8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            float8.weight, float8.bias = linear.weight, linear.bias
            setattr(parent, name, float8)
            converted += 1
    if cache_weights:
        linears = [(m, Float8WeightCache()) for m in model.modules() if isinstance(m, Float8Linear)]
        model.register_forward_pre_hook(partial(_refresh_float8_weights, linears))
    return converted


def _refresh_float8_weights(linears: list[tuple[Float8Linear, Float8WeightCache]], *_: Any) -> None:
    """Before a forward of the model: each linear's FP8 weight, quantized again only where the weight changed."""
    for linear, cache in linears:
        linear.float8_weight = cache.get((linear.weight.unsqueeze(0),))
