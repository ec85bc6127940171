"""HostScalars and DeviceMark on CUDA: values and times of queued work, read without making the host wait for it."""

import time

import pytest
import torch

from torchtitan.tools.async_readback import DeviceMark, HostScalars


def test_values_are_read_after_the_queued_work_that_computes_them():
    x, three = torch.randn(4096, 4096, device="cuda"), torch.tensor(3, device="cuda")
    # The first pass warms up: a kernel's first launch loads its module (lazy loading) and a new pinned host block
    # is allocated (cudaHostAlloc), and both wait for the device. The trainer's steady state is the second pass.
    for _ in range(2):
        torch.cuda.synchronize()
        for _ in range(200):  # ~0.5 s of queued fp32 GEMMs before the values exist
            x = torch.nn.functional.normalize(x @ x, dim=-1)
        loss, grad_norm = x.sum(), x.norm()
        scalars = HostScalars([loss, grad_norm, three])
        copied_without_waiting = not scalars.ready.reached()
        values = scalars.wait()
    assert values == pytest.approx([loss.item(), grad_norm.item(), 3.0], rel=1e-6)
    assert copied_without_waiting


def test_marks_time_the_queued_work_between_them_on_the_device():
    x = torch.randn(4096, 4096, device="cuda")
    x @ x  # warm-up: the GEMM's first launch loads its module
    torch.cuda.synchronize()
    begin = time.perf_counter()
    start = DeviceMark(x.device)
    for _ in range(100):  # ~0.25 s of fp32 GEMMs
        x = torch.nn.functional.normalize(x @ x, dim=-1)
    end = DeviceMark(x.device)
    end.synchronize()
    wall = time.perf_counter() - begin
    assert start.reached() and end.reached()
    assert 0.5 * wall < start.seconds_until(end) <= wall


def test_a_batch_goes_to_the_gpu_without_waiting_for_queued_work():
    """The trainer's batch transfer (`batch_to_device`) returns while earlier kernels still run, and the batch
    arrives intact once they have. A pageable copy would wait for them (the step then began on an empty queue)."""
    from torchtitan.train import batch_to_device

    x = torch.randn(4096, 4096, device="cuda")
    batch = torch.randint(0, 100_000, (4, 4096))
    for _ in range(2):  # the first pass warms up (module loading, the first pinned block)
        torch.cuda.synchronize()
        for _ in range(200):  # ~0.5 s of queued fp32 GEMMs
            x = torch.nn.functional.normalize(x @ x, dim=-1)
        on_device = batch_to_device(batch, x.device)
        returned_before_the_queue_ran = not torch.cuda.current_stream().query()
        assert torch.equal(on_device.cpu(), batch)
    assert returned_before_the_queue_ran
