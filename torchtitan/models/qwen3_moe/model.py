"""Qwen3-MoE: embedding -> n_layers x (GQA with q / k norms + MoE, or a dense FFN in `dense_layers`) -> norm -> head.

The blocks are every model's (`models/moe/block.py`) around Qwen3's attention; module names follow docs/design.md
(the parallelize and pipeline plans depend on them). The model knows nothing about parallelism: `parallelize` installs
what the parallel layouts need.
"""

from torchtitan.models.moe.block import TransformerBlock
from torchtitan.models.moe.decoder import Decoder
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE

from .args import Qwen3MoEModelArgs
from .attention import Attention
from .rope import precompute_freqs_cis

__all__ = ["Qwen3MoEModel"]


class Qwen3MoEModel(Decoder):
    """The shared trunk (`models/moe/decoder.py`, whose forward is this model's) of Qwen3's blocks."""

    def __init__(self, args: Qwen3MoEModelArgs):
        if args.mtp_layers:
            raise ValueError(f"mtp_layers={args.mtp_layers}: Qwen3-MoE has no multi-token prediction modules; use 0")
        super().__init__(args, _block, precompute_freqs_cis)


def _block(layer_id: int, args: Qwen3MoEModelArgs) -> TransformerBlock:
    """Layer `layer_id`: Qwen3's attention, then an MoE (a dense FFN in `dense_layers`)."""
    attention = Attention(args)
    if layer_id in args.dense_layers:
        ffn = FeedForward(args.dim, args.inter_dim)
    else:
        ffn = MoE(args.moe_args, args.dim, args.moe_inter_dim)
    return TransformerBlock(layer_id, attention, ffn, args.dim, args.norm_eps)
