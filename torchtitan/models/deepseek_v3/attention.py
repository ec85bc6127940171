"""Multi-head latent attention (MLA, DeepSeek-V2/V3) and the masks for causal and block-causal attention.

Queries: x -> wq (or wq_a -> q_norm -> wq_b) -> per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)].
Keys/values: x -> wkv_a -> [latent c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim, one head shared by all heads)];
c_kv -> kv_norm -> wkv_b -> per head [k_nope | v]. RoPE touches only q_pe and k_pe ("decoupled RoPE").
k = [k_nope | k_pe], so the qk head dim (nope + rope, 192) differs from the v head dim (128); SDPA allows that.
Context parallelism (`context_parallel`, set by parallelize): x holds this rank's part of each sequence; the latent
[c_kv after kv_norm | k_pe after RoPE] is all-gathered over the CP ranks before wkv_b, so k and v cover the whole
sequence and the mask (`build_attention_mask` over the queries' global positions) keeps attention causal.
"""

from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import nn

from .args import DeepSeekV3ModelArgs
from .rope import apply_rotary_emb, softmax_scale

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from torchtitan.distributed.context_parallel import ContextParallel

# None: plain causal attention; BlockMask: block-causal via flex_attention (CUDA);
# bool tensor (bs, 1, seqlen, seqlen), True = may attend: block-causal via SDPA (CPU).
AttentionMask = Union["BlockMask", torch.Tensor, None]

# flex_attention and its compiled form, loaded by the first `build_attention_mask` that makes a BlockMask: the
# import pulls in much of inductor (over a second per process), which causal attention never needs.
_flex_attention = None
_compiled_flex_attention = None  # flex_attention is only fast compiled; compilation happens at the first CUDA call

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


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: AttentionMask, scale: float
) -> torch.Tensor:
    """q, k: (bs, n_heads, seqlen, qk_head_dim); v: (bs, n_heads, seqlen, v_head_dim)."""
    if attention_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if isinstance(attention_mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale)
    flex = _compiled_flex_attention if q.is_cuda else _flex_attention  # a BlockMask: flex was loaded with it
    return flex(q, k, v, block_mask=attention_mask, scale=scale)


def build_attention_mask(
    document_ids: torch.Tensor | None,
    positions: torch.Tensor | None = None,
    kv_len: int | None = None,
    use_flex: bool | None = None,
) -> AttentionMask:
    """The mask for one forward pass, built once and shared by all layers: a query at global position p attends to
    the keys at positions <= p (of its own packed document with document ids).

    document_ids: (bs, kv_len) int over the whole sequence, equal ids = same packed document, or None.
    positions: (seqlen,) the queries' global positions (context parallelism: this rank's part of the sequence);
    None: all kv_len positions in order. Neither: plain causal attention (None, SDPA's is_causal).
    kv_len: the keys' sequence length; default document_ids' length.
    use_flex: BlockMask for flex_attention (default on CUDA) or a dense bool mask for SDPA (default elsewhere).
    """
    if document_ids is None and positions is None:
        return None
    kv_len = kv_len or document_ids.shape[1]
    device = (positions if positions is not None else document_ids).device
    if use_flex is None:
        use_flex = device.type == "cuda"
    if not use_flex:
        queries = positions if positions is not None else torch.arange(kv_len, device=device)
        mask = torch.arange(kv_len, device=device)[None, :] <= queries[:, None]  # (seqlen, kv_len)
        if document_ids is not None:
            mask = mask & (document_ids[:, queries, None] == document_ids[:, None, :])  # (bs, seqlen, kv_len)
        return mask.reshape(-1, 1, *mask.shape[-2:])  # (bs or 1, 1, seqlen, kv_len)

    def query_position(q_idx):
        return q_idx if positions is None else positions[q_idx]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= query_position(q_idx)

    def block_causal(b, h, q_idx, kv_idx):
        position = query_position(q_idx)
        return (kv_idx <= position) & (document_ids[b, position] == document_ids[b, kv_idx])

    global _flex_attention, _compiled_flex_attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_attention is None:
        _flex_attention, _compiled_flex_attention = flex_attention, torch.compile(flex_attention)
    # _compile on CUDA: builds the block mask without materializing a dense (bs, seqlen, kv_len) mask
    return create_block_mask(
        causal if document_ids is None else block_causal,
        B=None if document_ids is None else document_ids.shape[0],
        H=None,
        Q_LEN=kv_len if positions is None else positions.shape[0],
        KV_LEN=kv_len,
        device=device,
        _compile=device.type == "cuda",
    )
