"""Multi-head latent attention (MLA, DeepSeek-V2/V3); the masks and the attention call are `models/attention.py`'s.

Queries: x -> wq (or wq_a -> q_norm -> wq_b) -> per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)].
Keys/values: x -> wkv_a -> [latent c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim, one head shared by all heads)];
c_kv -> kv_norm -> wkv_b -> per head [k_nope | v]. RoPE touches only q_pe and k_pe ("decoupled RoPE").
k = [k_nope | k_pe], so the qk head dim (nope + rope, 192) differs from the v head dim (128); SDPA allows that.
Context parallelism (`context_parallel`, set by parallelize): x holds this rank's part of each sequence; the latent
[c_kv after kv_norm | k_pe after RoPE] is all-gathered over the CP ranks before wkv_b, so k and v cover the whole
sequence and the mask (`build_attention_mask` over the queries' global positions) keeps attention causal.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.models.attention import AttentionMask, attend

from .args import DeepSeekV3ModelArgs
from .rope import apply_rotary_emb, softmax_scale

if TYPE_CHECKING:
    from torchtitan.distributed.context_parallel import ContextParallel

# The latent norms (q_norm, kv_norm) keep RMSNorm's default eps whatever the config's rms_norm_eps, as DeepSeek's
# reference and transformers build them (Moonlight's rms_norm_eps is 1e-5; its latent norms still use 1e-6).
LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = softmax_scale(args)

        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.context_parallel: ContextParallel | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: AttentionMask) -> torch.Tensor:
        """x: (bs, seqlen, dim); freqs_cis: (seqlen, qk_rope_head_dim // 2) -> (bs, seqlen, dim)."""
        bs, seqlen, _ = x.shape

        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 instead of n_heads: under tensor parallelism this rank holds only some heads
        q = q.view(bs, seqlen, -1, self.qk_head_dim)  # (bs, seqlen, n_heads, qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)

        kv = self.wkv_a(x)  # (bs, seqlen, kv_lora_rank + qk_rope_head_dim)
        c_kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_norm(c_kv)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)  # (bs, seqlen, qk_rope_head_dim)
        if self.context_parallel is not None:  # the whole sequence's latent: (bs, kv_len, kv_lora_rank + rope dim)
            latent = self.context_parallel.gather_sequence(torch.cat([c_kv, k_pe], dim=-1))
            c_kv, k_pe = torch.split(latent, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_len = c_kv.shape[1]
        kv = self.wkv_b(c_kv)  # (bs, kv_len, n_heads * (qk_nope_head_dim + v_head_dim))
        kv = kv.view(bs, kv_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)
        k = torch.cat([k_nope, k_pe], dim=-1)  # (bs, kv_len, n_heads, qk_head_dim)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, n_heads, seqlen or kv_len, head_dim)
        out = attend(q, k, v, attention_mask, self.softmax_scale)  # (bs, n_heads, seqlen, v_head_dim)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (bs, seqlen, n_heads * v_head_dim)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        in_projections = [self.wkv_a, self.wkv_b]
        in_projections += [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in in_projections:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank > 0:
            self.q_norm.reset_parameters()
