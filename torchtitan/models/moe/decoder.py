"""The trunk every model here is built on: token embedding -> `layers` (the model's blocks) -> norm -> output head,
with the model's RoPE table in `freqs_cis`. A model gives its block and its RoPE; the parallelisms, the pipeline split
and the checkpoints read the module names this trunk fixes (docs/design.md), so a model gets them by inheriting it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.distributed.utils import transformer_blocks
from torchtitan.models.attention import AttentionMask, build_attention_mask
from torchtitan.models.output_head import OutputHead

if TYPE_CHECKING:
    from torchtitan.distributed.context_parallel import ContextParallel

__all__ = ["Decoder"]


class Decoder(nn.Module):
    """tok_embeddings -> layers "0".."n_layers-1" -> norm -> output. A pipeline stage sets the parts it does not hold
    to None (and deletes layers: the ModuleDict keeps the others' names). `parallelize` sets `context_parallel`, under
    which forward gets a part of each sequence. A model with more than the trunk (DeepSeek-V3's MTP modules) overrides
    forward, building on `_check_inputs`, `_embed` and `_rope_and_mask`.

    block: (layer_id, args) -> the model's transformer block. precompute_freqs_cis: (args, device) -> the model's
    RoPE table, fp32 (max_seq_len, ...), indexed by position.
    """

    def __init__(
        self,
        args: Any,
        block: Callable[[int, Any], nn.Module],
        precompute_freqs_cis: Callable[..., torch.Tensor],
    ):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed "0".."n-1" so pipeline splitting can delete layers and keep the others' names.
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self._precompute_freqs_cis = precompute_freqs_cis
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

    def _check_inputs(self, document_ids: torch.Tensor | None, labels: torch.Tensor | None) -> None:
        """What forward's keyword arguments need: document ids for block-causal attention, the whole model for
        labels."""
        if self.args.attn_mask_type == "block_causal" and document_ids is None:
            raise ValueError("attn_mask_type='block_causal' needs document_ids; pass model(tokens, document_ids=...)")
        if labels is not None and (self.output is None or self.norm is None):
            raise ValueError("labels= (the fused output loss) needs the whole model, not a pipeline stage")

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (bs, seqlen) -> their embeddings; hidden states (bs, seqlen, dim) on a stage without tok_embeddings
        pass as they are."""
        return self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens

    def _rope_and_mask(
        self, h: torch.Tensor, positions: torch.Tensor | None, document_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, AttentionMask]:
        """The RoPE table's rows of these hidden states' tokens (the first seqlen, or `positions` under context
        parallelism) and the attention mask over the whole sequences' keys."""
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
        return freqs_cis, build_attention_mask(document_ids, positions, kv_len)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize all parameters in place (DTensors too) and recompute freqs_cis on `buffer_device` (default:
        where the buffer is, or CPU when that is the meta device)."""
        if buffer_device is None:
            buffer_device = self.freqs_cis.device if self.freqs_cis.device.type != "meta" else "cpu"
        self.freqs_cis = self._precompute_freqs_cis(self.args, device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for block in transformer_blocks(self):
            block.init_weights(buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
