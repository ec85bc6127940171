"""Qwen3-MoE: embedding -> n_layers x (GQA with q / k norms + MoE, or a dense FFN in `dense_layers`) -> norm -> head.

The blocks are every model's (`models/moe/block.py`) around Qwen3's attention; module names follow docs/design.md
(the parallelize and pipeline plans depend on them). The model knows nothing about parallelism: `parallelize` installs
what the parallel layouts need.
"""

import torch

from torchtitan.models.moe.block import TransformerBlock
from torchtitan.models.moe.decoder import Decoder
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE

from .args import Qwen3MoEModelArgs
from .attention import Attention
from .rope import precompute_freqs_cis

__all__ = ["Qwen3MoEModel"]


class Qwen3MoEModel(Decoder):
    """The shared trunk (`models/moe/decoder.py`) of Qwen3's blocks."""

    def __init__(self, args: Qwen3MoEModelArgs):
        if args.mtp_layers:
            raise ValueError(f"mtp_layers={args.mtp_layers}: Qwen3-MoE has no multi-token prediction modules; use 0")
        super().__init__(args, _block, precompute_freqs_cis)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: (bs, seqlen) int, or hidden states (bs, seqlen, dim) on a pipeline stage without tok_embeddings.
        document_ids: (bs, seqlen), equal ids = same packed document; switches to block-causal attention.
        labels: (bs, seqlen) targets (IGNORE_INDEX: none); returns the fp32 cross-entropy token SUM instead of the
        logits (`OutputHead`, in row chunks). Not on pipeline stages.
        positions: (seqlen,) under context parallelism: the global positions of tokens (and labels) in sequences of
        context_parallel.degree x seqlen tokens (`ContextParallel.positions`), for RoPE and the causal mask;
        document_ids then covers the whole sequences: (bs, degree x seqlen).
        Returns logits (bs, seqlen, vocab), or hidden states (bs, seqlen, dim) on a stage without `output`.
        """
        self._check_inputs(document_ids, labels)
        h = self._embed(tokens)  # (bs, seqlen, dim)
        freqs_cis, attention_mask = self._rope_and_mask(h, positions, document_ids)
        for layer in self.layers.values():
            h = layer(h, freqs_cis, attention_mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        if labels.dim() != 2:
            raise ValueError(f"labels= is (bs, seqlen), got shape {tuple(labels.shape)}")
        return self.output(h, labels=labels)


def _block(layer_id: int, args: Qwen3MoEModelArgs) -> TransformerBlock:
    """Layer `layer_id`: Qwen3's attention, then an MoE (a dense FFN in `dense_layers`)."""
    attention = Attention(args)
    if layer_id in args.dense_layers:
        ffn = FeedForward(args.dim, args.inter_dim)
    else:
        ffn = MoE(args.moe_args, args.dim, args.moe_inter_dim)
    return TransformerBlock(layer_id, attention, ffn, args.dim, args.norm_eps)
