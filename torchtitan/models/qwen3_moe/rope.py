"""Rotary position embedding as Qwen3 (and transformers' `rotate_half`) computes it: a head's first and second halves
are the two coordinates of its pairs, (x[i], x[i + head_dim / 2]) rotated by the angle pos * freq_i,
freq_i = rope_theta ** (-2i / head_dim). Qwen's checkpoints store q_proj / k_proj for this layout, so they load
without a permutation (DeepSeek's interleaved pairs are `deepseek_v3/rope.py`'s).
"""

import torch

from .args import Qwen3MoEModelArgs


def precompute_freqs_cis(args: Qwen3MoEModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """(cos, sin) of pos * freq_i for every position and pair: fp32 (max_seq_len, head_dim // 2, 2), the layout of
    DeepSeek's table (the model's `freqs_cis` buffer, sliced and indexed alike by the parallelisms)."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (bs, seqlen, n_heads, head_dim), freqs_cis (seqlen, head_dim // 2, 2) -> x rotated, in x's dtype (computed
    in fp32): [x1 cos - x2 sin | x2 cos + x1 sin] for the halves x1, x2 of each head."""
    bs, seqlen, n_heads, head_dim = x.shape
    cos, sin = freqs_cis.view(1, seqlen, 1, head_dim // 2, 2).unbind(-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
