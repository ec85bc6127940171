"""The transformer block every model here builds around its own attention:

    h   = x + attention(attention_norm(x), freqs_cis, attention_mask)
    out = h + ffn(ffn_norm(h))            ffn: an `MoE`, or a dense SwiGLU `FeedForward`

Module names follow docs/design.md (the parallelize plans, checkpoints and the optimizer's parameter groups read
them). Its parts are the units of torch.compile and per-op SAC (`compile_parts`, `recompute_part`), so a model that
reuses the block gets both without code of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE

if TYPE_CHECKING:
    from torchtitan.distributed.compile import Compiler, MoERegions
    from torchtitan.models.attention import AttentionMask

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """x + attention(attention_norm(x)), then h + ffn(ffn_norm(h)) with a dense FFN or an MoE.

    attention: the model's attention, called as attention(x, freqs_cis, attention_mask) on (bs, slen, dim), with
    `init_weights(init_std)`. ffn: `MoE` (the block is an MoE block: `moe_enabled`, its FFN at `moe`) or
    `FeedForward` (at `feed_forward`).
    """

    def __init__(self, layer_id: int, attention: nn.Module, ffn: MoE | FeedForward, dim: int, norm_eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.moe_enabled = isinstance(ffn, MoE)
        if self.moe_enabled:
            self.moe = ffn
        else:
            self.feed_forward = ffn
        # Output projections get smaller init the deeper the layer (torchtitan's depth init).
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: AttentionMask) -> torch.Tensor:
        """x (bs, slen, dim) -> (bs, slen, dim)."""
        h = self.attention_residual(x, freqs_cis, attention_mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_input(h))

    def compile_parts(self, compiler: Compiler, regions: MoERegions) -> bool:
        """An MoE block compiles its parts, not itself whole (`distributed/compile.py` says why); a dense block
        is compiled whole (False)."""
        if not self.moe_enabled:
            return False
        self.attention_residual = compiler.function(self.attention_residual)
        self.ffn_input = compiler.function(self.ffn_input)
        self.moe.compile_parts(compiler, regions)
        return True

    def recompute_part(self, on: bool) -> bool:
        """Per-op SAC's unit in an MoE block is its routed experts (`activation_checkpoint.PartialRecompute`); a
        dense block is checkpointed whole (False)."""
        if not self.moe_enabled:
            return False
        self.moe.experts.recompute = on
        return True

    def attention_residual(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: AttentionMask
    ) -> torch.Tensor:
        """x + attention(attention_norm(x)): a method of its own so that an MoE block compiles the norm and the add
        with the attention (`distributed/compile.py`)."""
        return x + self.attention(self.attention_norm(x), freqs_cis, attention_mask)

    def ffn_input(self, h: torch.Tensor) -> torch.Tensor:
        """ffn_norm(h), under autocast cast once to its dtype (else each of an MoE's three consumers casts it and
        backward sums their gradients in fp32). A method so an MoE block compiles the norm and cast as one kernel."""
        normed = self.ffn_norm(h)
        device = h.device.type
        if torch.is_autocast_enabled(device):
            normed = normed.to(torch.get_autocast_dtype(device))
        return normed

    def init_weights(self, buffer_device: torch.device | str) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.init_std)
