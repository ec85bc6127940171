"""Out of memory as one line: what counts as one, and what the line names."""

import torch

from torchtitan.tools.out_of_memory import is_out_of_memory, out_of_memory_line


def test_allocator_and_runtime_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    # outside the caching allocator (NCCL, DeepEP): torch.AcceleratorError, a RuntimeError
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_the_line_names_rank_step_and_the_settings_that_lower_the_peak():
    line = out_of_memory_line(rank=3, step=2, device=None)
    assert "\n" not in line and line.startswith("error: rank 3 ran out of device memory at step 2;")
    knobs = ("--activation_checkpoint.memory_budget_gib B", "--training.local_batch_size", "mode full", "reshard_after")
    for knob in knobs:
        assert knob in line
    assert "before the first step" in out_of_memory_line(rank=0, step=0, device=None)
