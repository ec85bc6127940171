"""DeepSeek-V3: embedding -> n_layers x (MLA + dense FFN or MoE) -> norm -> output head.

Module names follow docs/design.md (the parallelize and pipeline plans depend on them).
The model knows nothing about parallelism: `parallelize` installs what the parallel layouts need.
"""

import torch
from torch import nn

from torchtitan.models.attention import AttentionMask
from torchtitan.models.moe.block import TransformerBlock as MoETransformerBlock
from torchtitan.models.moe.decoder import Decoder
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE

from .args import DeepSeekV3ModelArgs
from .attention import MLA
from .rope import precompute_freqs_cis


class DeepSeekV3Model(Decoder):
    """The shared trunk (`models/moe/decoder.py`) of MLA blocks, with DeepSeek-V3's multi-token prediction modules
    after the last layer."""

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__(args, TransformerBlock, precompute_freqs_cis)
        # Multi-token prediction modules "0".."D-1" (HF: model.layers.{n_layers + k}), sharing embedding and head.
        self.mtp = nn.ModuleDict({str(k): MTPBlock(args.n_layers + k, args) for k in range(args.mtp_layers)})

    def forward(
        self,
        tokens: torch.Tensor,
        mtp_embeddings: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        next_tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """tokens: (bs, seqlen) int, or hidden states (bs, seqlen, dim) on a pipeline stage without tok_embeddings.
        document_ids: (bs, seqlen), equal ids = same packed document; switches to block-causal attention.
        next_tokens: (bs, seqlen) the token after each position (the labels); with MTP modules, also returns their
        logits: MTP module k (0-based) at position i predicts token i + k + 2 from token i + k + 1's embedding.
        mtp_embeddings: (mtp_layers, bs, seqlen, dim), those embeddings, computed on the embedding's pipeline stage
        and carried by every later stage to the MTP modules on the last one.
        labels: (bs, seqlen) targets (IGNORE_INDEX: none); returns the fp32 cross-entropy token SUM instead of the
        logits (`OutputHead`, in row chunks). With MTP modules and next_tokens: (bs, 1 + modules, seqlen), the labels
        then each module's targets (`mtp_targets`), returning the token sums (main, each module). Not on PP stages.
        positions: (seqlen,) under context parallelism: the global positions of tokens (and labels) in sequences
        of context_parallel.degree x seqlen tokens (`ContextParallel.positions`), for RoPE and the causal mask;
        document_ids and next_tokens then cover the whole sequences: (bs, degree x seqlen).
        Returns logits (bs, seqlen, vocab), or hidden states (bs, seqlen, dim) on a stage without `output`;
        (logits, MTP logits (bs, seqlen, vocab) of each module) when next_tokens is given and MTP modules exist (a
        flat tuple of tensors: pipeline stages send and return nothing else);
        (hidden states, mtp_embeddings) on a pipeline stage before the MTP modules.
        """
        self._check_inputs(document_ids, labels)
        if mtp_embeddings is not None and (self.tok_embeddings is not None or not self.args.mtp_layers):
            raise ValueError(
                "mtp_embeddings only pass between pipeline stages of a model with MTP modules; pass document_ids "
                "and next_tokens by keyword"
            )
        h = self._embed(tokens)  # (bs, seqlen, dim)
        freqs_cis, attention_mask = self._rope_and_mask(h, positions, document_ids)
        training_mtp = self.args.mtp_layers > 0 and (next_tokens is not None or mtp_embeddings is not None)
        mtp_here = training_mtp and len(self.mtp) > 0
        # a pipeline stage before the MTP modules: pass their inputs on (computed on the embedding's stage)
        mtp_later = training_mtp and len(self.mtp) == 0
        if mtp_later and mtp_embeddings is None:
            mtp_embeddings = torch.stack([self._mtp_embedding(next_tokens, k) for k in range(self.args.mtp_layers)])
        for layer in self.layers.values():
            h = layer(h, freqs_cis, attention_mask)
        if mtp_later:
            return h, mtp_embeddings
        head_labels = self._head_labels(labels, mtp_here)
        logits = self.norm(h) if self.norm is not None else h
        logits = self._head(logits, head_labels[0]) if self.output is not None else logits
        if not mtp_here:
            return logits
        mtp_logits = []
        for k, block in enumerate(self.mtp.values()):
            embedding = (
                mtp_embeddings[k] if mtp_embeddings is not None else self._mtp_embedding(next_tokens, k, positions)
            )
            h, normed = block(h, embedding, freqs_cis, attention_mask)
            mtp_logits.append(self._head(normed, head_labels[k + 1]))
        return logits, *mtp_logits

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Logits, or with labels the loss token sum (`OutputHead`)."""
        return self.output(h) if labels is None else self.output(h, labels=labels)

    def _head_labels(self, labels: torch.Tensor | None, mtp_here: bool) -> list[torch.Tensor | None]:
        """The labels of the main head and of each MTP module's head (None: the head returns logits)."""
        heads = 1 + (self.args.mtp_layers if mtp_here else 0)
        if labels is None:
            return [None] * heads
        if not mtp_here:
            if labels.dim() != 2:
                raise ValueError(f"labels= without MTP is (bs, seqlen), got shape {tuple(labels.shape)}")
            return [labels]
        if labels.dim() != 3 or labels.shape[1] != heads:
            raise ValueError(
                f"labels= with {self.args.mtp_layers} MTP modules is (bs, {heads}, seqlen): the labels, then each "
                f"module's targets; got shape {tuple(labels.shape)}"
            )
        return list(labels.unbind(1))

    def _mtp_embedding(
        self, next_tokens: torch.Tensor, module: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The embedding of token i + module + 1 at position i (of `positions`, default all), from next_tokens over the
        whole sequence; the last `module` positions repeat the final token (their targets are ignored)."""
        seqlen = next_tokens.shape[1]
        if positions is None:
            positions = torch.arange(seqlen, device=next_tokens.device)
        return self.tok_embeddings(next_tokens[:, (positions + module).clamp(max=seqlen - 1)])


class TransformerBlock(MoETransformerBlock):
    """The shared block (`models/moe/block.py`) with MLA; a dense FFN in the first `n_dense_layers` layers."""

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        attention = MLA(args)  # built before the FFN: the order default inits draw in
        if layer_id >= args.n_dense_layers:
            ffn = MoE(args.moe_args, args.dim, args.moe_inter_dim)
        else:
            ffn = FeedForward(args.dim, args.inter_dim)
        super().__init__(layer_id, attention, ffn, args.dim, args.norm_eps)


class MTPBlock(TransformerBlock):
    """One multi-token prediction module (DeepSeek-V3 report, section 2.2), a transformer block with a projection in
    front: h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]), h_i^k = block(h'_i), logits = head(head_norm(h^k)).

    The concatenation puts the embedding first, as the released weights expect (the report's equation writes the
    hidden state first). HF names: model.layers.{n_layers + k}.enorm / hnorm / eh_proj / shared_head.norm and the
    block's own weights; the embedding and the output head are the main model's.
    """

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__(layer_id, args)
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.head_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, h: torch.Tensor, next_embedding: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h (bs, slen, dim) of the previous depth (before its final norm), next_embedding (bs, slen, dim) ->
        (this depth's h for the next module, head_norm(h) for the output head). The norm runs here, inside the
        module's call, where FSDP has its weight unsharded."""
        x = self.eh_proj(torch.cat([self.enorm(next_embedding), self.hnorm(h)], dim=-1))
        # Under autocast (one device, no FSDP) the projection computes in bf16 but the trunk's residual stream is
        # fp32: keep the trunk's dtype, so this block runs the compiled MoE graphs the trunk's blocks run (a bf16
        # stream compiled second graphs mid-step, which activation checkpointing refuses).
        h = super().forward(x.to(h.dtype), freqs_cis, attention_mask)
        return h, self.head_norm(h)

    def init_weights(self, buffer_device: torch.device | str) -> None:
        super().init_weights(buffer_device)
        for norm in (self.enorm, self.hnorm, self.head_norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
