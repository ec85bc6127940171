"""What lets one kernel launch walk a list of tensors: the chunk table and the per-step address table.

One program per chunk of `CHUNK` elements; the chunk table (cached per size list) tells a program which tensor and
chunk it owns. Addresses change every step (new gradients), so they go into a table built on the host and copied to
the device each step: one host-to-device copy, no synchronization.
"""

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["CHUNK", "ChunkTable", "chunk_table", "to_device_tables"]

# Elements per program. Large enough that a program's table lookups are a small part of its work, small enough
# that the last wave of programs is short (2.2B elements are 270k programs).
CHUNK = 8192


@dataclass(frozen=True)
class ChunkTable:
    """Program i updates elements [chunk_in_tensor[i] * CHUNK, ... + CHUNK) of tensor tensor_of_chunk[i]."""

    tensor_of_chunk: torch.Tensor  # (num_chunks,) int32
    chunk_in_tensor: torch.Tensor  # (num_chunks,) int32
    numels: torch.Tensor  # (num_tensors,) int64

    @property
    def num_chunks(self) -> int:
        return self.tensor_of_chunk.numel()


@functools.lru_cache(maxsize=64)
def chunk_table(numels: tuple[int, ...], device: torch.device) -> ChunkTable:
    """The chunk table of tensors with these element counts, on `device` (cached: it depends on sizes only)."""
    chunks_per_tensor = torch.tensor([math.ceil(n / CHUNK) for n in numels], dtype=torch.int64)
    tensor_of_chunk = torch.repeat_interleave(torch.arange(len(numels)), chunks_per_tensor)
    first_chunk_of_tensor = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    chunk_in_tensor = torch.arange(tensor_of_chunk.numel()) - first_chunk_of_tensor[tensor_of_chunk]
    return ChunkTable(
        tensor_of_chunk=tensor_of_chunk.to(device=device, dtype=torch.int32),
        chunk_in_tensor=chunk_in_tensor.to(device=device, dtype=torch.int32),
        numels=torch.tensor(numels, dtype=torch.int64, device=device),
    )


def to_device_tables(
    addresses: list[int], scalars: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 `addresses` and fp32 `scalars` (1-D, on the host) -> both on `device` in one asynchronous copy from pinned
    memory (the scalars ride in the tail of the int64 buffer, two per word)."""
    num_addresses, num_scalars = len(addresses), scalars.numel()
    host = torch.empty(num_addresses + (num_scalars + 1) // 2, dtype=torch.int64, pin_memory=True)
    host[:num_addresses] = torch.tensor(addresses, dtype=torch.int64)
    host[num_addresses:].view(torch.float32)[:num_scalars] = scalars
    on_device = host.to(device, non_blocking=True)
    return on_device[:num_addresses], on_device[num_addresses:].view(torch.float32)[:num_scalars]
