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


def _host_allocation_failure() -> RuntimeError:
    """What torch's CPU allocator raises when malloc fails (1 PiB: past any address space)."""
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("a 1 PiB allocation succeeded")


def test_a_failed_cpu_allocation_is_out_of_memory_named_as_cpu_memory_with_the_settings_that_apply_there():
    """On a CPU the GPU's settings (a memory budget, FSDP resharding) do not apply: the line names the batch, the
    sequence length and activation checkpointing."""
    err = _host_allocation_failure()
    assert is_out_of_memory(err) and is_out_of_memory(MemoryError())
    line = out_of_memory_line(rank=0, step=1, device=torch.device("cpu"), err=err)
    assert line == (
        "error: rank 0 ran out of CPU memory at step 1 (an allocation of 1048576.0 GiB failed); lower the peak with a "
        "smaller --training.local_batch_size or --training.seq_len (fewer tokens per rank), or "
        "--activation_checkpoint.mode full"
    )
    assert out_of_memory_line(rank=2, step=0, device=None, err=MemoryError()).startswith(
        "error: rank 2 ran out of CPU memory before the first step; lower the peak with a smaller"
    )
    # on a GPU host, the GPU's own out-of-memory is still the device's
    gpu = out_of_memory_line(rank=0, step=3, device=None, err=torch.OutOfMemoryError("CUDA out of memory."))
    assert "ran out of device memory at step 3" in gpu
