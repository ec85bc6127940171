"""CudaGraphed on CUDA: eager warm-up calls, one capture, then replays that compute on each call's inputs what an eager
call computes (gradients included), outputs the next call overwrites, and one error naming what could not replay."""

import subprocess
import sys

import pytest
import torch

from torchtitan.tools.cuda_graph import CudaGraphed


def training_step(weight: torch.Tensor):
    """A step as the trainer's: drop the gradient, forward, backward; returns (loss,)."""

    def step(x: torch.Tensor) -> tuple[torch.Tensor]:
        weight.grad = None
        loss = torch.tanh(x @ weight).square().mean()
        loss.backward()
        return (loss.detach(),)

    return step


def eager_reference(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    reference = weight.detach().clone().requires_grad_()
    loss = torch.tanh(x @ reference).square().mean()
    loss.backward()
    return loss.detach(), reference.grad


def test_replays_compute_each_calls_loss_and_gradient_as_an_eager_call():
    torch.manual_seed(0)
    weight = (torch.randn(256, 256, device="cuda") / 16).requires_grad_()  # x @ weight ~ N(0, 1): tanh unsaturated
    graphed = CudaGraphed(training_step(weight), warmup_calls=2, name="test step")
    for call in range(1, 7):
        x = torch.randn(128, 256, device="cuda")
        (loss,) = graphed(x)
        expected_loss, expected_grad = eager_reference(weight, x)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-6)  # same kernels on another stream
        torch.testing.assert_close(weight.grad, expected_grad, rtol=1e-4, atol=1e-6)
        assert graphed.captured == (call > 2)
        with torch.no_grad():
            weight -= 0.1 * weight.grad  # an optimizer between steps: replays read the updated weight
    assert graphed.replays == 4


def test_a_replay_overwrites_the_previous_calls_outputs():
    """The documented contract: a caller keeping an output past the next call clones it."""
    weight = torch.randn(64, 64, device="cuda", requires_grad=True)
    graphed = CudaGraphed(training_step(weight), warmup_calls=1, name="test step")
    graphed(torch.randn(32, 64, device="cuda"))
    first = graphed(torch.randn(32, 64, device="cuda"))[0]
    kept = first.clone()
    x = torch.randn(32, 64, device="cuda")
    second = graphed(x)[0]
    assert second is first
    torch.testing.assert_close(second, eager_reference(weight, x)[0], rtol=1e-4, atol=1e-6)
    assert not torch.equal(kept, second)


def test_inputs_of_other_shapes_are_one_error():
    weight = torch.randn(64, 64, device="cuda", requires_grad=True)
    graphed = CudaGraphed(training_step(weight), warmup_calls=1, name="test step")
    graphed(torch.randn(32, 64, device="cuda"))
    graphed(torch.randn(32, 64, device="cuda"))
    with pytest.raises(ValueError, match=r"test step: a CUDA graph replays the shapes it captured, \[\(\(32, 64\)"):
        graphed(torch.randn(16, 64, device="cuda"))


FAILED_CAPTURE = """
import pytest, torch
from torchtitan.tools.cuda_graph import CudaGraphed

def step(x):
    if x.sum().item() > 0:  # a host read of a device value: not capturable
        x = x * 2
    return (x,)

graphed = CudaGraphed(step, warmup_calls=1, name="test step")
graphed(torch.ones(8, device="cuda"))
with pytest.raises(RuntimeError, match=r"^test step: capturing call 2 in a CUDA graph failed \\(.*\\): something"):
    graphed(torch.ones(8, device="cuda"))
torch.cuda.synchronize()  # the device works on after a failed capture
assert torch.ones(8, device="cuda").sum().item() == 8
print("ok")
"""


def test_a_call_that_waits_on_the_host_fails_capture_with_one_error():
    """In its own process: a failed capture leaves the process's CUDA RNG registered to the dead graph (later random
    ops raise "Offset increment outside graph capture"), which is why the trainer exits on it."""
    proc = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
