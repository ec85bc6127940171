"""Qwen3-MoE: embedding -> n_layers x (GQA with q / k norms + MoE, or a dense FFN in `dense_layers`) -> norm -> head.

The blocks are every model's (`models/moe/block.py`) around Qwen3's attention; module names follow docs/design.md
(the parallelize and pipeline plans depend on them). The model knows nothing about parallelism: `parallelize` installs
what the parallel layouts need.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.models.attention import build_attention_mask
from torchtitan.models.moe.block import TransformerBlock
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE
from torchtitan.models.output_head import OutputHead

from .args import Qwen3MoEModelArgs
from .attention import Attention
from .rope import precompute_freqs_cis

if TYPE_CHECKING:
    from torchtitan.distributed.context_parallel import ContextParallel

__all__ = ["Qwen3MoEModel"]


class Qwen3MoEModel(nn.Module):
    def __init__(self, args: Qwen3MoEModelArgs):
        super().__init__()
        if args.mtp_layers:
            raise ValueError(f"mtp_layers={args.mtp_layers}: Qwen3-MoE has no multi-token prediction modules; use 0")
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed "0".."n-1" so pipeline splitting can delete layers and keep the others' names.
        self.layers = nn.ModuleDict({str(i): _block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        # context parallelism (set by parallelize, like every attention's): forward gets a part of each sequence
        self.context_parallel: ContextParallel | None = None

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
        if self.args.attn_mask_type == "block_causal" and document_ids is None:
            raise ValueError("attn_mask_type='block_causal' needs document_ids; pass model(tokens, document_ids=...)")
        if labels is not None and (self.output is None or self.norm is None):
            raise ValueError("labels= (the fused output loss) needs the whole model, not a pipeline stage")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (bs, seqlen, dim)
        seqlen = h.shape[1]
        kv_len = seqlen * (self.context_parallel.degree if self.context_parallel is not None else 1)
        if kv_len > self.freqs_cis.shape[0]:
            raise ValueError(f"seqlen {kv_len} > max_seq_len {self.freqs_cis.shape[0]}; raise model max_seq_len")
        if (positions is None) != (self.context_parallel is None):
            raise ValueError(
                "positions= is this rank's part of each sequence: pass it exactly under context parallelism"
            )
        if self.freqs_cis.dtype != torch.float32:
            raise RuntimeError(
                f"freqs_cis is {self.freqs_cis.dtype}, not float32 (model.to(dtype) casts buffers too, and bf16 angles "
                "rotate far positions wrongly); cast with FSDP mixed precision instead, or recompute: "
                "model.freqs_cis = precompute_freqs_cis(model.args, device)"
            )
        freqs_cis = self.freqs_cis[:seqlen] if positions is None else self.freqs_cis[positions]
        attention_mask = build_attention_mask(document_ids, positions, kv_len)
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

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize all parameters in place (DTensors too) and recompute freqs_cis on `buffer_device` (default:
        where the buffer is, or CPU when that is the meta device)."""
        if buffer_device is None:
            buffer_device = self.freqs_cis.device if self.freqs_cis.device.type != "meta" else "cpu"
        self.freqs_cis = precompute_freqs_cis(self.args, device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def _block(layer_id: int, args: Qwen3MoEModelArgs) -> TransformerBlock:
    """Layer `layer_id`: Qwen3's attention, then an MoE (a dense FFN in `dense_layers`)."""
    attention = Attention(args)
    if layer_id in args.dense_layers:
        ffn = FeedForward(args.dim, args.inter_dim)
    else:
        ffn = MoE(args.moe_args, args.dim, args.moe_inter_dim)
    return TransformerBlock(layer_id, attention, ffn, args.dim, args.norm_eps)
