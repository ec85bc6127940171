"""YaRN rotary position embedding, as in DeepSeek's reference (interleaved pairs, rotated as complex numbers).

The rotary part of a head is read as pairs (x0, x1), (x2, x3), ... and pair i is rotated by angle pos * freq_i.
HF DeepSeek-V3 checkpoints store the rope dims in this interleaved order (transformers' `rope_interleave=True`).

YaRN's two temperatures, as DeepSeek-V2's code and transformers' DeepseekV2/V3 apply them, with m(s) = 0.1 s ln(factor)
+ 1: the softmax scale is multiplied by m(mscale_all_dim)^2 (every head dim), and cos/sin by m(mscale) /
m(mscale_all_dim) (the rotary dims of q and k); a zero (absent) mscale or mscale_all_dim makes the latter m(1), and a
zero mscale_all_dim leaves the softmax scale alone. DeepSeek's published configs set both equal, so only the softmax
scale changes.
"""

import math

import torch

from .args import DeepSeekV3ModelArgs


def yarn_enabled(args: DeepSeekV3ModelArgs) -> bool:
    """YaRN context extension is on when the model is configured past its pretraining length."""
    return args.max_seq_len > args.original_seq_len


def softmax_scale(args: DeepSeekV3ModelArgs) -> float:
    """qk_head_dim ** -0.5, times YaRN's attention temperature m(mscale_all_dim)^2 when YaRN is on."""
    scale = args.qk_head_dim**-0.5
    if yarn_enabled(args):
        mscale = _yarn_mscale(args.rope_factor, args.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def rotary_scale(args: DeepSeekV3ModelArgs) -> float:
    """The factor on cos/sin (transformers' `attention_factor`): m(mscale) / m(mscale_all_dim) with YaRN, else 1."""
    if not yarn_enabled(args):
        return 1.0
    if args.mscale and args.mscale_all_dim:
        return _yarn_mscale(args.rope_factor, args.mscale) / _yarn_mscale(args.rope_factor, args.mscale_all_dim)
    return _yarn_mscale(args.rope_factor, 1.0)


def precompute_freqs_cis(args: DeepSeekV3ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """exp(i * pos * freq) for every position and rotary pair as its (cos, sin): fp32 (max_seq_len,
    qk_rope_head_dim // 2, 2), real because inductor generates no code for complex tensors."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))  # (dim // 2,)

    if yarn_enabled(args):
        # High-frequency pairs (many rotations within original_seq_len) keep their frequency, low-frequency pairs
        # are interpolated by 1 / rope_factor, with a linear ramp between the two correction dims.
        low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
        if low == high:
            high += 0.001  # avoid dividing by zero
        ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
        smooth = 1 - ramp.clamp(0, 1)
        freqs = freqs / args.rope_factor * (1 - smooth) + freqs * smooth

    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, freqs)  # (max_seq_len, dim // 2)
    freqs_cis = torch.stack([angles.cos(), angles.sin()], dim=-1)
    if (scale := rotary_scale(args)) != 1.0:
        freqs_cis = freqs_cis * scale
    return freqs_cis


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x's last dim: x (bs, seqlen, n_heads, rope_dim), freqs_cis (seqlen, rope_dim // 2, 2)
    each pair's (cos, sin). Computed in fp32, returned in x's dtype. Real arithmetic (the complex multiply's products)
    so inductor fuses it with its neighbours; a complex multiply is an eager fallback there.
    """
    bs, seqlen, n_heads, rope_dim = x.shape
    cos, sin = freqs_cis.view(1, seqlen, 1, rope_dim // 2, 2).unbind(-1)
    real, imag = x.float().reshape(bs, seqlen, n_heads, rope_dim // 2, 2).unbind(-1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(3).to(x.dtype)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's temperature m = 0.1 * mscale * ln(factor) + 1 (1 without interpolation)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, original_seq_len: int) -> float:
    """The rotary dim whose wavelength fits `num_rotations` times into original_seq_len."""
    return dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
