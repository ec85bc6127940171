"""A function of device tensors replayed as one CUDA graph after a few eager calls: the host then launches it with one
call instead of each of its kernels, and nothing inside it can wait on the host."""

import logging
from collections.abc import Callable

import torch

__all__ = ["CudaGraphed"]

logger = logging.getLogger(__name__)


class CudaGraphed:
    """`fn(*inputs) -> tuple of tensors`: eager for its first `warmup_calls` calls, then captured once and replayed.

    The warm-up calls do what capture cannot: compile, autotune, initialize libraries, grow the allocator's pools. They
    run on the side stream the capture uses, as PyTorch's recipe has it, so that state made lazily per stream (library
    workspaces, autograd's gradient accumulators) exists before capture; the caller's stream waits for them. The next
    call is captured into a `torch.cuda.CUDAGraph` (capture records the work without running it, so the graph is
    replayed once for that call); every later call copies its inputs into the captured ones and replays. Replays write
    the same output tensors: a caller that keeps an output past the next call clones it. What fn does on the host
    (Python state, a tensor made on the CPU) happens once, at capture: fn must queue the same device work on inputs of
    the same shapes every call and return everything its caller reads. `before_capture` runs on the host just before
    capture: it drops what the captured call allocates anew (a step's gradients), so their memory is released.
    """

    def __init__(
        self,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        warmup_calls: int,
        name: str,
        before_capture: Callable[[], None] | None = None,
    ):
        if warmup_calls < 1:
            raise ValueError(f"warmup_calls={warmup_calls}: capture needs at least one eager call before it")
        self.fn = fn
        self.warmup_calls = warmup_calls
        self.name = name
        self.before_capture = before_capture
        self.calls = 0
        self.replays = 0
        self._stream: torch.cuda.Stream | None = None  # made at the first call, so that constructing needs no GPU
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[torch.Tensor, ...] = ()
        self._outputs: tuple[torch.Tensor, ...] = ()

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        if self._graph is None:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            if self.calls <= self.warmup_calls:
                return self._run_eagerly(inputs)
            self._capture(inputs)
        else:
            self._copy_inputs(inputs)
        self._graph.replay()
        self.replays += 1
        return self._outputs

    def _run_eagerly(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """fn on the capture's stream, between two waits: it starts after the caller's queued work and the caller's
        later work waits for it, so memory either stream frees is never reused under the other's pending kernels."""
        caller = torch.cuda.current_stream()
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            outputs = tuple(self.fn(*inputs))
        caller.wait_stream(self._stream)
        return outputs

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> None:
        self._inputs = tuple(t.detach().clone() for t in inputs)
        if self.before_capture is not None:
            self.before_capture()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream):  # synchronizes the device first: once, here
                outputs = tuple(self.fn(*self._inputs))
        except RuntimeError as err:
            raise RuntimeError(
                f"{self.name}: capturing call {self.calls} in a CUDA graph failed ({_first_error(err)}): something "
                "in it waits on the host (.item(), a blocking copy, an output sized by data) or cannot be captured; "
                "run a call under torch.cuda.set_sync_debug_mode('error') to find the op that syncs"
            ) from err
        self._graph, self._outputs = graph, outputs
        logger.info(f"{self.name}: call {self.calls} captured in one CUDA graph, replayed from now on")

    def _copy_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each call's inputs into the captured ones, in stream order (the replay reads them)."""
        got = [(tuple(t.shape), t.dtype) for t in inputs]
        captured = [(tuple(t.shape), t.dtype) for t in self._inputs]
        if got != captured:
            raise ValueError(
                f"{self.name}: a CUDA graph replays the shapes it captured, {captured}; this call passed {got}: keep "
                "every call's inputs the same shapes, or run without CUDA graphs"
            )
        for captured_input, new_input in zip(self._inputs, inputs, strict=True):
            captured_input.copy_(new_input)


def _first_error(err: BaseException) -> str:
    """The first line of the error that started it: a failed capture raises again when the capture ends."""
    while err.__context__ is not None:
        err = err.__context__
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
