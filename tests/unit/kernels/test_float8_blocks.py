"""FP8 weights with one scale per block of rows x columns (DeepSeek's release layout), partial edge blocks included."""

import pytest
import torch

from torchtitan.kernels.float8_blocks import dequantize_blocks, quantize_blocks, scale_shape

BLOCK = (32, 48)  # not square: rows and columns must not be swapped
SHAPE = (70, 100)  # 3 x 3 blocks, the last row and column of blocks partial (6 rows, 4 columns)


def _fp8_weight(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(SHAPE, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(scale_shape(SHAPE, BLOCK), generator=gen) + 0.5
    return values, scale_inv


def test_scale_shape_counts_partial_edge_blocks():
    assert scale_shape(SHAPE, BLOCK) == (3, 3)
    assert scale_shape((7168, 2048), (128, 128)) == (56, 16)  # DeepSeek-V3's experts' down_proj
    assert scale_shape((576, 7168), (128, 128)) == (5, 56)  # its kv_a_proj_with_mqa: a partial row of blocks


def test_dequantize_multiplies_each_block_by_its_scale():
    values, scale_inv = _fp8_weight()
    expected = values.float().clone()
    for i in range(3):
        for j in range(3):
            expected[i * 32 : (i + 1) * 32, j * 48 : (j + 1) * 48] *= scale_inv[i, j]
    torch.testing.assert_close(dequantize_blocks(values, scale_inv, BLOCK), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "rows, cols",
    [
        (slice(0, 70), slice(0, 100)),
        (slice(5, 40), slice(47, 49)),
        (slice(31, 70), slice(50, 100)),
        (slice(64, 65), slice(0, 1)),
    ],
)
def test_a_region_dequantized_alone_is_that_region_of_the_whole(rows, cols):
    """What a rank holding one shard of a weight reads: its rows and columns and the scales of the blocks they
    touch."""
    values, scale_inv = _fp8_weight()
    blocks = (slice(rows.start // 32, -(-rows.stop // 32)), slice(cols.start // 48, -(-cols.stop // 48)))
    region = dequantize_blocks(values[rows, cols], scale_inv[blocks], BLOCK, (rows.start, cols.start))
    torch.testing.assert_close(region, dequantize_blocks(values, scale_inv, BLOCK)[rows, cols], rtol=0, atol=0)


def test_quantize_scales_each_block_by_its_amax_and_round_trips_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(SHAPE, generator=gen) * torch.logspace(-3, 2, SHAPE[1])  # magnitudes vary across blocks
    weight[32:64, 48:96] = 0  # an all-zero block
    values, scale_inv = quantize_blocks(weight, BLOCK)
    assert values.dtype == torch.float8_e4m3fn and values.shape == SHAPE
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            block = weight[i * 32 : (i + 1) * 32, j * 48 : (j + 1) * 48]
            amax = block.abs().max()
            assert scale_inv[i, j] == (amax / 448 if amax > 0 else 1), (i, j)  # DeepSeek's scale, 1 for zeros
    back = dequantize_blocks(values, scale_inv, BLOCK)
    # e4m3: 3 mantissa bits (relative rounding <= 2^-4), subnormal spacing 2^-9 of the block's scale
    scale_of_each = scale_inv.repeat_interleave(32, 0)[:70].repeat_interleave(48, 1)[:, :100]
    bound = torch.maximum(weight.abs() * 2**-4, scale_of_each * 2**-10)
    assert ((back - weight).abs() <= bound).all()
    assert (back[32:64, 48:96] == 0).all()
    assert (back - weight).abs().max() > 0  # it did round
