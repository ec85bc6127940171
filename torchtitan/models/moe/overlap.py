"""Two-micro-batch overlap of an MoE layer: one micro-batch's token exchange runs while the other computes.

`MicroBatchOverlap` splits the layer's input in two (A, B) along the batch and runs both through `MoE.stages`,
interleaved so that every dispatch and combine runs on a communication stream next to the other's compute:

    compute stream                                   communication stream
    route A, shared experts A
    route B, shared experts B                        dispatch A
    experts A (after dispatch A)                     dispatch B
    experts B (after dispatch B)                     combine A
    output A (after combine A)                       combine B
    output B (after combine B)

A communication stage is issued once the other micro-batch has queued its next compute, so a dispatch that waits on
the host for its receive counts does so while the GPU has work queued. Backward needs no schedule: autograd runs each
backward op on its forward op's stream and reaches the interleaved ops in mirrored order.

Stream safety: each stage waits for an event recorded right after its inputs were produced, the compute stream waits
for one recorded after the stage, and `record_stream` keeps cross-stream tensors from being reused early. On CPU,
while compiling, or without a communication stream the stages run inline in the same order (what the CPU parity
tests check). Unlike Megatron's merged forward/backward of consecutive micro-batches, this needs no trainer schedule
and works with one micro-batch per step, FSDP2 and every activation-checkpointing mode.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from torchtitan.tools.tensor_tree import tensors_in

__all__ = ["MicroBatchOverlap"]


class MicroBatchOverlap:
    """Runs an MoE layer on two halves of its batch with their stages interleaved (module docstring). comm_stream: one
    per model (`parallelize` creates it); None runs inline (CPU)."""

    def __init__(self, comm_stream: torch.cuda.Stream | None):
        self.comm_stream = comm_stream

    def __call__(self, stages: Callable[[torch.Tensor], Generator], x: torch.Tensor) -> torch.Tensor:
        """stages: `MoE.stages`; x (bs, slen, dim) with bs even -> (bs, slen, dim)."""
        if x.shape[0] % 2:
            raise ValueError(
                f"expert-parallel overlap splits the batch into 2 micro-batches, but it holds {x.shape[0]} sequences; "
                "use a local batch size divisible by 2"
            )
        streams = _Streams(self.comm_stream, x.device)
        return torch.cat(_interleave(streams, [stages(half) for half in x.chunk(2)]))


def _interleave(streams: _Streams, micro_batches: list[Generator]) -> list[torch.Tensor]:
    """Advance the micro-batches in turn; each one's communication is issued after the other has advanced."""
    held: list[Any] = [None, None]  # a yielded stage not issued yet, with the event after its inputs
    issued: list[Any] = [None, None]  # the stage in flight, to receive when the micro-batch resumes
    outputs: list[Any] = [None, None]
    finished = [False, False]

    def advance(i: int) -> None:
        try:
            stage = micro_batches[i].send(streams.receive(issued[i]) if issued[i] is not None else None)
            held[i] = (streams.mark(), stage)
        except StopIteration as done:
            finished[i], outputs[i] = True, done.value

    advance(0)
    turn = 1
    while not all(finished):
        if not finished[turn]:
            advance(turn)
        other = 1 - turn
        if held[other] is not None:
            event, (stage, args) = held[other]
            issued[other], held[other] = streams.communicate(event, stage, *args), None
        turn = other
    return outputs


class _Streams:
    """The current (compute) stream and the communication stream; inline where there is none."""

    def __init__(self, comm_stream: torch.cuda.Stream | None, device: torch.device):
        self.enabled = comm_stream is not None and device.type == "cuda" and not torch.compiler.is_compiling()
        if self.enabled:
            self.compute = torch.cuda.current_stream(device)
            self.comm = comm_stream

    def mark(self) -> torch.cuda.Event | None:
        """An event after the compute queued so far: what a later communication stage waits for."""
        return self.compute.record_event() if self.enabled else None

    def communicate(self, after: torch.cuda.Event | None, fn: Callable, *args: Any) -> tuple[Any, Any]:
        """Run fn(*args) on the communication stream once `after` has passed -> (result, done event)."""
        if not self.enabled:
            return fn(*args), None
        self.comm.wait_event(after)
        with torch.cuda.stream(self.comm):
            result = fn(*args)
        for tensor in tensors_in(args):
            tensor.record_stream(self.comm)
        return result, self.comm.record_event()

    def receive(self, pending: tuple[Any, Any]) -> Any:
        """The result of `communicate`, once the compute stream has waited for it."""
        result, done = pending
        if done is not None:
            self.compute.wait_event(done)
            for tensor in tensors_in(result):
                tensor.record_stream(self.compute)
        return result
