"""Out of device memory as one line: which rank, at which step, how full its device was, and the settings that lower
the peak (instead of a CUDA traceback that names none of them)."""

from __future__ import annotations

import torch

__all__ = ["is_out_of_memory", "out_of_memory_line"]

LOWER_MEMORY = (
    "--activation_checkpoint.memory_budget_gib {budget} (recompute picked per MoE block to fit; lower it if set), "
    "a smaller --training.local_batch_size (fewer tokens per rank), --activation_checkpoint.mode full, or "
    "--parallelism.fsdp_reshard_after_forward always"
)
BUDGET_SHARE = 0.91  # of the card's memory: what lies outside the allocator (NCCL, DeepEP's buffers) and a margin


def is_out_of_memory(err: BaseException) -> bool:
    """The caching allocator raises `torch.OutOfMemoryError`; an allocation outside it (NCCL's or DeepEP's buffers,
    library workspaces) surfaces as a RuntimeError ("CUDA error: out of memory")."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def out_of_memory_line(rank: int, step: int, device: torch.device | None) -> str:
    """step 0: before the first training step (building the model, its optimizer, its buffers)."""
    where = f"at step {step}" if step > 0 else "before the first step"
    held, budget = "", "B"
    if device is not None and device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        held, budget = f" with {reserved:.1f} of {total:.1f} GiB reserved", str(int(total * BUDGET_SHARE))
    lower = LOWER_MEMORY.format(budget=budget)
    return f"error: rank {rank} ran out of device memory {where}{held}; lower the peak with {lower}"
