"""FP8 (e4m3) weights with one scale per block of rows x columns: the layout of DeepSeek's FP8 releases on Hugging Face
(`quantization_config.weight_block_size`, 128 x 128 there), where a weight W (out, in) is stored as float8_e4m3fn
values Q and a float32 `weight_scale_inv` S of shape (ceil(out / rows), ceil(in / cols)) with

    W[i, j] = Q[i, j] * S[i // rows, j // cols]

Blocks at the bottom and right edges may be partial. Quantizing scales each block by its absolute maximum / 448 (the
largest e4m3 value), as DeepSeek's `weight_quant` does; an all-zero block gets scale 1.
"""

import math

import torch

from torchtitan.kernels.float8 import FP8_DTYPE, FP8_MAX

__all__ = ["dequantize_blocks", "quantize_blocks", "scale_shape"]


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the block scales of a 2-D weight: one per block, partial edge blocks included."""
    rows, cols = weight_shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize_blocks(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """The float32 weights of FP8 `values` (R, C), a region of a weight that starts at row, column `start`;
    `scale_inv` holds the scales of the blocks the region touches (its first row and column are those of the block
    holding `start`). Multiplied one block row at a time, so the only temporary is the float32 result."""
    block_rows, block_cols = block
    row0, col0 = start
    num_rows, num_cols = values.shape
    out = values.to(torch.float32)
    # (block rows touched, C): each block row's scales repeated over its columns, cropped to the region
    first_col = col0 % block_cols
    column_scales = scale_inv.float().repeat_interleave(block_cols, dim=1)[:, first_col : first_col + num_cols]
    for i, scales in enumerate(column_scales):
        block_top = (row0 // block_rows + i) * block_rows
        out[max(block_top, row0) - row0 : min(block_top + block_rows, row0 + num_rows) - row0] *= scales
    return out


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (R, C) -> (float8_e4m3fn values (R, C), float32 scales `scale_shape`), `dequantize_blocks`'s inverse up
    to e4m3's rounding: each block divided by its scale, absolute maximum / 448."""
    num_rows, num_cols = weight.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = scale_shape(weight.shape, block)
    padded = weight.new_zeros(grid_rows * block_rows, grid_cols * block_cols, dtype=torch.float32)
    padded[:num_rows, :num_cols] = weight
    blocks = padded.view(grid_rows, block_rows, grid_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3))  # (grid_rows, grid_cols)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (blocks / scale[:, None, :, None]).to(FP8_DTYPE).view(padded.shape)
    return values[:num_rows, :num_cols].contiguous(), scale
