import dataclasses
import math

import pytest
import torch

from torchtitan.models.attention import attend, build_attention_mask
from torchtitan.models.deepseek_v3.attention import MLA
from torchtitan.models.deepseek_v3.rope import apply_rotary_emb, precompute_freqs_cis, softmax_scale

from .conftest import tiny_args


def _angles(freqs_cis: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(freqs_cis.contiguous()).angle()


def _table(angles: torch.Tensor) -> torch.Tensor:
    """The (cos, sin) table of these angles, from torch.polar: the values precompute_freqs_cis gives."""
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def test_freqs_cis_shape_and_unit_modulus(args):
    freqs_cis = precompute_freqs_cis(args)
    assert freqs_cis.shape == (args.max_seq_len, args.qk_rope_head_dim // 2, 2)
    assert freqs_cis.dtype == torch.float32  # real: inductor has no code for complex tensors
    cos, sin = freqs_cis.unbind(-1)
    torch.testing.assert_close(cos * cos + sin * sin, torch.ones(cos.shape))
    torch.testing.assert_close(freqs_cis, _table(_angles(freqs_cis)))  # (cos, sin) of one angle per pair


def test_yarn_changes_low_frequencies_and_softmax_scale_only_past_original_len():
    plain = tiny_args(max_seq_len=64, original_seq_len=64, rope_factor=4.0, mscale=0.7, mscale_all_dim=0.7)
    yarn = dataclasses.replace(plain, max_seq_len=128, original_seq_len=32)
    assert softmax_scale(plain) == pytest.approx(plain.qk_head_dim**-0.5)
    mscale = 0.1 * 0.7 * math.log(4.0) + 1
    assert softmax_scale(yarn) == pytest.approx(yarn.qk_head_dim**-0.5 * mscale**2)
    f_plain, f_yarn = _angles(precompute_freqs_cis(plain))[1], _angles(precompute_freqs_cis(yarn))[1]
    assert torch.allclose(f_plain[0], f_yarn[0])  # highest frequency kept
    assert torch.allclose(f_yarn[-1], f_plain[-1] / 4.0)  # lowest frequency interpolated by 1 / rope_factor


def test_rotary_emb_rotates_interleaved_pairs():
    x = torch.tensor([1.0, 0.0, 0.0, 2.0]).view(1, 1, 1, 4)  # pairs (1, 0) and (0, 2)
    freqs_cis = _table(torch.tensor([[math.pi / 2, math.pi]]))
    expected = torch.tensor([0.0, 1.0, 0.0, -2.0]).view(1, 1, 1, 4)
    torch.testing.assert_close(apply_rotary_emb(x, freqs_cis), expected, atol=1e-6, rtol=0)


def _complex_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The rotation as a complex multiply (the formulation the real arithmetic replaced)."""
    bs, seqlen, n_heads, rope_dim = x.shape
    x_complex = torch.view_as_complex(x.float().reshape(bs, seqlen, n_heads, rope_dim // 2, 2))
    rotation = torch.view_as_complex(freqs_cis.contiguous()).view(1, seqlen, 1, rope_dim // 2)
    return torch.view_as_real(x_complex * rotation).flatten(3).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_emb_equals_complex_multiply_eager_and_compiled(dtype):
    """Same values bit for bit as the complex multiply, on a split (non-contiguous) view as MLA passes it, eager and
    compiled (where inductor fuses the real arithmetic; a complex multiply would be an eager fallback)."""
    torch.manual_seed(0)
    freqs_cis = _table(torch.randn(12, 8))
    q = torch.randn(2, 12, 3, 24, dtype=dtype)
    q_pe = q[..., 8:]  # (2, 12, 3, 16), strided
    expected = _complex_rotary_emb(q_pe, freqs_cis)
    assert torch.equal(apply_rotary_emb(q_pe, freqs_cis), expected)
    assert torch.equal(torch.compile(apply_rotary_emb, fullgraph=True)(q_pe, freqs_cis), expected)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_output_shape_and_dtype(q_lora_rank):
    args = tiny_args(q_lora_rank=q_lora_rank)
    mla = MLA(args)
    assert hasattr(mla, "wq") == (q_lora_rank == 0)
    assert hasattr(mla, "wq_b") == (q_lora_rank > 0)
    x = torch.randn(2, 10, args.dim)
    out = mla(x, precompute_freqs_cis(args)[:10], None)
    assert out.shape == (2, 10, args.dim) and out.dtype == torch.float32


def test_mla_is_causal():
    args = tiny_args()
    mla = MLA(args)
    freqs_cis = precompute_freqs_cis(args)[:12]
    x = torch.randn(1, 12, args.dim)
    x_changed = x.clone()
    x_changed[:, 8:] = torch.randn(1, 4, args.dim)
    torch.testing.assert_close(mla(x, freqs_cis, None)[:, :8], mla(x_changed, freqs_cis, None)[:, :8])


@pytest.mark.parametrize("use_flex", [False, True])
def test_block_causal_equals_each_document_alone(use_flex):
    torch.manual_seed(0)
    bs, n_heads, seqlen, qk_dim, v_dim = 2, 3, 23, 24, 16
    q, k = torch.randn(bs, n_heads, seqlen, qk_dim), torch.randn(bs, n_heads, seqlen, qk_dim)
    v = torch.randn(bs, n_heads, seqlen, v_dim)
    lengths = [[5, 11, 7], [23]]
    document_ids = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])

    out = attend(q, k, v, build_attention_mask(document_ids, use_flex=use_flex), scale=0.3)

    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            doc = slice(start, start + n)
            alone = attend(q[b : b + 1, :, doc], k[b : b + 1, :, doc], v[b : b + 1, :, doc], None, scale=0.3)
            torch.testing.assert_close(out[b : b + 1, :, doc], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_flex_and_sdpa_block_causal_paths_agree():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 24), torch.randn(2, 4, 40, 24), torch.randn(2, 4, 40, 16)
    document_ids = torch.randint(0, 3, (2, 40)).sort(dim=1).values
    sdpa = attend(q, k, v, build_attention_mask(document_ids, use_flex=False), scale=0.2)
    flex = attend(q, k, v, build_attention_mask(document_ids, use_flex=True), scale=0.2)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
