"""Qwen3's attention: grouped-query attention with an RMSNorm on every query and key head before RoPE.

    q = RoPE(q_norm(x wq))   per query head (n_heads)
    k = RoPE(k_norm(x wk))   per key / value head (n_kv_heads; each serves n_heads / n_kv_heads query heads)
    v = x wv
    out = softmax(q k^T / sqrt(head_dim) + mask) v, its heads concatenated -> wo

q_norm and k_norm normalize each head's head_dim values with one weight shared by all heads. Context parallelism
(`context_parallel`, set by parallelize): x holds this rank's part of each sequence; k and v (after k_norm and RoPE)
are all-gathered over the CP ranks, 2 x n_kv_heads x head_dim values per token (1,024 for Qwen3-30B-A3B), so they
cover the whole sequence and the mask over the queries' global positions keeps attention causal.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.models.attention import AttentionMask, attend

from .args import Qwen3MoEModelArgs
from .rope import apply_rotary_emb

if TYPE_CHECKING:
    from torchtitan.distributed.context_parallel import ContextParallel

__all__ = ["Attention"]


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoEModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.context_parallel: ContextParallel | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: AttentionMask) -> torch.Tensor:
        """x: (bs, seqlen, dim); freqs_cis: (seqlen, head_dim // 2, 2) -> (bs, seqlen, dim)."""
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism this rank holds only some heads
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_heads, head_dim)
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        if self.context_parallel is not None:  # the whole sequence's keys and values: (bs, kv_len, n_kv_heads, ...)
            kv = self.context_parallel.gather_sequence(torch.cat([k, v], dim=-1).flatten(2))
            k, v = kv.view(bs, kv.shape[1], -1, 2 * self.head_dim).chunk(2, dim=-1)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seqlen or kv_len, head_dim)
        out = attend(q, k, v, attention_mask, self.head_dim**-0.5, enable_gqa=True)  # (bs, n_heads, seqlen, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            norm.reset_parameters()
