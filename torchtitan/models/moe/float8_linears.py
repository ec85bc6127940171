"""FP8 dense linears (`quantize.float8_linears`): the attention projections and every SwiGLU FFN (the dense
layers' and the shared experts') run their GEMMs in FP8 with rowwise scales, forward and backward, with the
routed experts' recipe (`float8_linear`). The router gate, the output head and DeepSeek-V3's MTP projection stay bf16.
Which linears are attention projections is the model's structure (docs/design.md): the nn.Linear children of each
block's `attention`, whatever attention the model has."""

import torch
from torch import nn

from torchtitan.distributed.utils import transformer_blocks, unwrapped_block
from torchtitan.kernels.float8 import float8_linear
from torchtitan.models.moe.feed_forward import FeedForward

__all__ = ["Float8Linear", "convert_to_float8_linears"]


class Float8Linear(nn.Linear):
    """An nn.Linear computed by `float8_linear`; the same parameters and state-dict keys (checkpoints load
    either way). Its input's rows (batch x sequence) must be a multiple of 16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = float8_linear(x, self.weight)
        return out if self.bias is None else out + self.bias


def convert_to_float8_linears(model: nn.Module) -> int:
    """Swap the nn.Linear children of every block's attention and of every FeedForward of `model` for Float8Linear;
    returns how many. Raises naming the fix when a weight's dims are not multiples of 16 (the FP8 GEMMs' alignment)."""
    attentions = {id(unwrapped_block(block).attention) for block in transformer_blocks(model)}
    converted = 0
    for parent_name, parent in list(model.named_modules()):
        if id(parent) not in attentions and not isinstance(parent, FeedForward):
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
    return converted
