"""Read a model's part from a Hugging Face safetensors folder, one region of one tensor at a time.

A process holding part of a model (a pipeline stage, an FSDP shard, its experts under EP) reads only that part and
opens only the shards that hold it; nothing of the checkpoint is held beyond the region being copied. FP8
block-scaled weights, as DeepSeek releases them (`<name>` in float8_e4m3fn with a float32 `<name>_scale_inv`, one
factor per block of config.json's `quantization_config.weight_block_size`), are dequantized as they are read, once
their block scales are checked (`check_block_scales`: every reader of a folder goes through `HFCheckpoint.read_into`).

How a model's tensor is made of the checkpoint's is the model's business: its state-dict adapter maps each of its
tensor names to an `HFSource` (one HF tensor, several stacked, or none: zeros).
"""

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from torchtitan.components.hf_safetensors import (
    INCOMPLETE_FIX,
    INDEX_FILE,
    DamagedCheckpointError,
    reading_shard,
    weight_map,
)
from torchtitan.kernels.float8_blocks import dequantize_blocks, scale_shape

__all__ = ["HFCheckpoint", "HFSource"]

SCALE_SUFFIX = "_scale_inv"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names (a header's "dtype") -> torch's."""


@dataclass(frozen=True)
class HFSource:
    """Where one of a model's tensors comes from in a HF checkpoint: the tensor `keys[0]`, or (`stacked`) the tensors
    `keys` stacked along a new dim 0 (one per routed expert); no keys: the checkpoint does not store it, zeros."""

    keys: tuple[str, ...] = ()
    stacked: bool = False


class HFCheckpoint:
    """A HF safetensors folder: where each tensor lies (its index json, else every shard's header), which weights are
    FP8 with block scales, and reads of any region of them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.weight_map = weight_map(folder)  # tensor name -> shard path
        self.index = os.path.join(folder, INDEX_FILE) if os.path.exists(os.path.join(folder, INDEX_FILE)) else None
        self.listed: dict[str, set[str]] = {}  # shard path -> the tensor names the index lists in it
        for name, path in self.weight_map.items():
            self.listed.setdefault(path, set()).add(name)
        self.scales = _scales_of_weights(folder, self.weight_map)  # FP8 weight name -> its scales' name
        self.block = _fp8_block_size(folder, self.scales) if self.scales else None  # (rows, cols) per scale

    def keys(self) -> list[str]:
        """The checkpoint's tensor names, less the FP8 scales (each is part of its weight)."""
        scales = set(self.scales.values())
        return [name for name in self.weight_map if name not in scales]

    def shapes(self, state: Mapping[str, torch.Tensor], sources: Mapping[str, HFSource]) -> dict[str, tuple[int, ...]]:
        """For each tensor of `state` that `sources` names, its shape in the checkpoint (a stacked one: (n, *shape)),
        from the headers of the HF tensors this process reads into it, so of only the shards it reads; where it reads
        nothing (zeros, or an empty shard), the tensor's own. ValueError where an FP8 weight's scales do not fit it,
        so that reading cannot fail on that."""
        reads = {name: _keys_read(state[name], source) for name, source in sources.items() if name in state}
        keys = {key for read in reads.values() for key in read}
        headers = self._headers(keys | {self.scales[key] for key in keys if key in self.scales})
        for key in sorted(keys):
            self._check_fp8(key, headers)
        shapes = {}
        for name, read in reads.items():
            if not read:
                shapes[name] = tuple(state[name].shape)
                continue
            first = headers[read[0]][1]
            if not sources[name].stacked:
                shapes[name] = first
                continue
            if other := next((key for key in read if headers[key][1] != first), None):
                raise ValueError(
                    f"{other} is {list(headers[other][1])} but {read[0]} {list(first)}: the tensors stacked into "
                    f"{name} differ in shape"
                )
            shapes[name] = (len(sources[name].keys), *first)
        return shapes

    def dtypes(self, sources: Mapping[str, HFSource]) -> dict[str, torch.dtype]:
        """The dtype each tensor `sources` reads comes in: as stored, float32 for FP8 block-scaled weights."""
        keys = {source.keys[0]: name for name, source in sources.items() if source.keys}
        headers = self._headers(set(keys))
        return {name: torch.float32 if key in self.scales else _DTYPES[headers[key][0]] for key, name in keys.items()}

    def read_into(self, state: Mapping[str, torch.Tensor], sources: Mapping[str, HFSource]) -> None:
        """Fill in place this process's share of each tensor of `state` that `sources` names: a DTensor's local
        shard, else the whole tensor (zeros where the source has no keys). Shards are opened one after another, each
        once and only if it holds a region read here; a region is read, dequantized if FP8, copied (cast to the
        target's dtype and device) and dropped before the next."""
        reads: dict[str, list[_Read]] = {}  # shard path -> its reads
        for name, target in state.items():
            if (source := sources.get(name)) is None:
                continue
            local, start = _local_share(target)
            if local.numel() == 0:
                continue
            if not source.keys:
                local.zero_()
            elif source.stacked:  # local rows 0, 1, ... are the tensors keys[start[0]], keys[start[0] + 1], ...
                for row, key in enumerate(source.keys[start[0] : start[0] + local.shape[0]]):
                    reads.setdefault(self.weight_map[key], []).append(_Read(key, start[1:], local[row]))
            else:
                key = source.keys[0]
                reads.setdefault(self.weight_map[key], []).append(_Read(key, start, local))
        for path in sorted(reads):
            with reading_shard(path), safe_open(path, framework="pt") as shard:
                for read in reads[path]:
                    read.target.copy_(self._read(shard, path, read))

    def _read(self, shard: Any, path: str, read: "_Read") -> torch.Tensor:
        region = tuple(slice(begin, begin + size) for begin, size in zip(read.start, read.target.shape, strict=True))
        values = shard.get_slice(read.key)[region]
        if (scale_key := self.scales.get(read.key)) is None:
            return values
        rows, cols = region
        block_rows, block_cols = self.block
        # the blocks the region touches (ceil division for the last)
        blocks = (slice(rows.start // block_rows, -(-rows.stop // block_rows)),
                  slice(cols.start // block_cols, -(-cols.stop // block_cols)))  # fmt: skip
        scale_path = self.weight_map[scale_key]
        if scale_path == path:
            scale_inv = shard.get_slice(scale_key)[blocks]
        else:
            with reading_shard(scale_path), safe_open(scale_path, framework="pt") as other:
                scale_inv = other.get_slice(scale_key)[blocks]
        where = f"{scale_key} (in {scale_path})"
        check_block_scales(where, values, scale_inv, self.block, (rows.start, cols.start))
        return dequantize_blocks(values, scale_inv, self.block, (rows.start, cols.start))

    def _headers(self, keys: set[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """(safetensors dtype, shape) of `keys`, each shard holding some of them opened once."""
        by_shard: dict[str, list[str]] = {}
        for key in keys:
            by_shard.setdefault(self.weight_map[key], []).append(key)
        headers = {}
        for path, names in sorted(by_shard.items()):
            with reading_shard(path), safe_open(path, framework="pt") as shard:
                self._check_listed(path, set(shard.keys()))
                for key in names:
                    entry = shard.get_slice(key)
                    headers[key] = (entry.get_dtype(), tuple(entry.get_shape()))
        return headers

    def _check_listed(self, path: str, held: set[str]) -> None:
        """The tensors a shard holds are those the index lists in it: else the folder mixes an export with parts of
        another, or a shard was rewritten after its index (an interrupted export or download)."""
        if self.index is None:
            return
        problem = f"the folder is incomplete or mixed (an interrupted export or download); {INCOMPLETE_FIX}"
        if absent := sorted(self.listed[path] - held):
            raise DamagedCheckpointError(
                f"{self.index} lists {len(absent)} tensor(s) in {path} that it does not hold, e.g. {absent[0]}: "
                f"{problem}"
            )
        if unlisted := sorted(held - self.weight_map.keys()):
            raise DamagedCheckpointError(
                f"{path} holds {len(unlisted)} tensor(s) that {self.index} does not list, e.g. {unlisted[0]}: {problem}"
            )

    def _check_fp8(self, key: str, headers: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        dtype, shape = headers[key]
        if (scale_key := self.scales.get(key)) is None:
            if dtype.startswith("F8"):
                raise ValueError(
                    f"{key} is {dtype} without a {key}{SCALE_SUFFIX} to dequantize it: a damaged checkpoint? fetch it "
                    "again"
                )
            return
        scale = headers[scale_key][1]
        if dtype != "F8_E4M3" or len(shape) != 2 or scale != scale_shape(shape, self.block):
            raise ValueError(
                f"{key} ({dtype} {list(shape)}) does not fit its {scale_key} {list(scale)}: FP8 block scaling takes a "
                f"2-D F8_E4M3 weight with one scale per {self.block[0]} x {self.block[1]} block (weight_block_size in "
                f"{os.path.join(self.folder, 'config.json')})"
            )


def check_block_scales(
    where: str, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], start: tuple[int, int]
) -> None:
    """DamagedCheckpointError naming the first block whose scale cannot be right: NaN, inf or below 0 (its weights would
    be NaN, inf or sign-flipped), or 0 over FP8 values that are not all 0 (they would load as a block of zeros).
    `values` (R, C) is a region of the weight starting at row, column `start`, `scale_inv` the scales of the blocks it
    touches (as `dequantize_blocks` takes them), `where` names the scale tensor."""
    block_rows, block_cols = block
    row0, col0 = start
    first_row, first_col = row0 // block_rows, col0 // block_cols  # the block holding `start`
    damaged = ~torch.isfinite(scale_inv) | (scale_inv < 0)
    for i, j in (scale_inv == 0).nonzero().tolist():  # a zero scale is right only over a block of zeros
        top, left = (first_row + i) * block_rows, (first_col + j) * block_cols
        rows = slice(max(top, row0) - row0, top + block_rows - row0)
        cols = slice(max(left, col0) - col0, left + block_cols - col0)
        damaged[i, j] = bool(values[rows, cols].float().ne(0).any())
    if not damaged.any():
        return
    i, j = damaged.nonzero()[0].tolist()
    value = scale_inv[i, j].item()
    over = " over FP8 values that are not all 0, which would load as zeros" if value == 0 else ""
    raise DamagedCheckpointError(
        f"{where} holds {value:g} for block [{first_row + i}, {first_col + j}] (of {block_rows} x {block_cols}, "
        f"counted from 0){over}: a block scale is a finite number above 0; the checkpoint is damaged, fetch it again"
    )


@dataclass
class _Read:
    key: str  # the HF tensor
    start: tuple[int, ...]  # where the region begins in it; its size is the target's
    target: torch.Tensor


def _keys_read(target: torch.Tensor, source: HFSource) -> tuple[str, ...]:
    """The HF tensors read into this process's share of `target`."""
    local, start = _local_share(target)
    if local.numel() == 0 or not source.stacked:
        return source.keys if local.numel() else ()
    return source.keys[start[0] : start[0] + local.shape[0]]


def _local_share(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this process's part of `tensor`, where that part begins in the whole): a DTensor's local shard, else all."""
    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()  # how DCP itself locates a DTensor's local shard
        return tensor.to_local(), tuple(chunk.offsets)
    return tensor, (0,) * tensor.dim()


def _scales_of_weights(folder: str, names: Iterable[str]) -> dict[str, str]:
    """FP8 weight name -> the name of its block scales (`<weight>_scale_inv`); a scale without its weight is an
    error."""
    names = set(names)
    scales = {name.removesuffix(SCALE_SUFFIX): name for name in names if name.endswith(SCALE_SUFFIX)}
    if orphans := sorted(scale for weight, scale in scales.items() if weight not in names):
        raise ValueError(
            f"{folder} holds {orphans[0]} but not the weight {orphans[0].removesuffix(SCALE_SUFFIX)} it scales: a "
            "damaged checkpoint? fetch it again"
        )
    return scales


def _fp8_block_size(folder: str, scales: dict[str, str]) -> tuple[int, int]:
    """(rows, cols) of an FP8 scale block, from the folder's config.json: its quantization_config, DeepSeek's being
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}."""
    path = os.path.join(folder, "config.json")
    holds = f"{folder} holds FP8 weights with block scales (e.g. {min(scales.values())})"
    fix = "put the release's config.json, with its quantization_config, into the folder"
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{holds} but no config.json giving their block size: {fix}") from None
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); fix the file") from None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict):
        raise ValueError(f"{holds} but {path} has no quantization_config giving their block size: {fix}")
    method, fmt, block = (quantization.get(key) for key in ("quant_method", "fmt", "weight_block_size"))
    if method != "fp8" or fmt not in (None, "e4m3"):
        raise ValueError(
            f"{path}: quantization_config {quantization} is not supported; FP8 e4m3 with block scales is (quant_method "
            "fp8, fmt e4m3, weight_block_size), as DeepSeek releases it"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(type(n) is int and n > 0 for n in block)):
        raise ValueError(
            f"{path}: quantization_config.weight_block_size {block!r} must be two positive whole numbers, [rows, cols] "
            "of a scale block (DeepSeek's: [128, 128])"
        )
    return block[0], block[1]
