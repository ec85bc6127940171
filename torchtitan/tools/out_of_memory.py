"""Out of memory as one line: which rank, at which step, how full its device was, and the settings that lower the
peak (instead of a CUDA or CPU-allocator traceback that names none of them)."""

from __future__ import annotations

import re

import torch

__all__ = ["is_out_of_memory", "out_of_memory_line"]

LOWER_MEMORY = (
    "--activation_checkpoint.memory_budget_gib {budget} (recompute picked per MoE block to fit; lower it if set), "
    "a smaller --training.local_batch_size (fewer tokens per rank), --activation_checkpoint.mode full, or "
    "--parallelism.fsdp_reshard_after_forward always"
)
LOWER_HOST_MEMORY = (
    "a smaller --training.local_batch_size or --training.seq_len (fewer tokens per rank), or "
    "--activation_checkpoint.mode full"
)  # the memory budget measures a GPU: not offered here
BUDGET_SHARE = 0.91  # of the card's memory: what lies outside the allocator (NCCL, DeepEP's buffers) and a margin
HOST_ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
"""What torch's CPU allocator raises (a RuntimeError) when malloc fails: on Linux / macOS, on Windows."""


def is_out_of_memory(err: BaseException) -> bool:
    """The caching allocator raises `torch.OutOfMemoryError`; an allocation outside it (NCCL's or DeepEP's buffers,
    library workspaces) surfaces as a RuntimeError ("CUDA error: out of memory"); host memory as the CPU allocator's
    RuntimeError or Python's MemoryError."""
    if isinstance(err, torch.OutOfMemoryError) or _is_host_out_of_memory(err):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err)


def out_of_memory_line(rank: int, step: int, device: torch.device | None, err: BaseException | None = None) -> str:
    """step 0: before the first training step (building the model, its optimizer, its buffers). err: the error, which
    tells host memory (the CPU's) from the device's."""
    where = f"at step {step}" if step > 0 else "before the first step"
    if err is not None and _is_host_out_of_memory(err):
        tried = re.search(r"you tried to allocate (\d+) bytes", str(err))
        could_not = f" (an allocation of {int(tried[1]) / 2**30:.1f} GiB failed)" if tried else ""
        return f"error: rank {rank} ran out of CPU memory {where}{could_not}; lower the peak with {LOWER_HOST_MEMORY}"
    held, budget = "", "B"
    if device is not None and device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        held, budget = f" with {reserved:.1f} of {total:.1f} GiB reserved", str(int(total * BUDGET_SHARE))
    lower = LOWER_MEMORY.format(budget=budget)
    return f"error: rank {rank} ran out of device memory {where}{held}; lower the peak with {lower}"


def _is_host_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    return isinstance(err, RuntimeError) and any(failure in str(err) for failure in HOST_ALLOCATOR_FAILURES)
