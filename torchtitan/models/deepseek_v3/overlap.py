"""Two-micro-batch overlap of an MoE block: one micro-batch's token exchange runs while the other computes.

`DeepSeekV3Model` splits each rank's batch in two (A, B) when `overlap_micro_batches` is 2 and passes both through
every block. An MoE block then interleaves their stages so that every dispatch and combine (the communication
stages of the layer's `TokenDispatcher`) runs on a communication stream next to compute of the other micro-batch:

    compute stream                                   communication stream
    attention A, route A
    attention B, route B                             dispatch A
    shared experts A, experts A (after dispatch A)   dispatch B
    experts B (after dispatch B)                     combine A
    output A (after combine A), shared experts B     combine B
    output B (after combine B)

The host issues dispatch B after A's experts: a dispatch that waits on the host for its receive counts (DeepEP's
normal dispatch, the all-to-all split sizes) then does so while the GPU has A's experts queued, instead of leaving
the compute stream idle until the host gets past the wait.
Backward needs no schedule of its own: autograd runs each backward op on the stream of its forward op and, going by
creation order, reaches the interleaved ops in the mirrored order, so the backward of a dispatch or combine (a
combine or a dispatch) again runs next to the other micro-batch's compute.

Stream safety: each communication stage waits for an event recorded on the compute stream right after its inputs
were produced (not for everything queued since), and the compute stream waits for an event recorded after the
stage. `record_stream` marks tensors that cross streams as in use by the other stream too, so the caching allocator
cannot hand their memory out while the other stream still reads them. On CPU (gloo) and without CUDA streams the
stages run inline in the same order, which is what the CPU parity tests check against the plain forward.

Why this scheme and not Megatron's merged forward/backward of consecutive gradient-accumulation micro-batches: it
needs no pipeline-like schedule in the trainer, works with one micro-batch per step, with FSDP2 and with every
activation-checkpointing mode (the checkpointed block recomputes the same interleaved forward), and hides the
backward's communication through autograd's ordering alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchtitan.tools.tensor_tree import tensors_in

__all__ = ["CommStreams", "forward_moe_block_overlapped", "moe_overlapped", "route_and_prepare"]

_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class CommStreams:
    """The current (compute) stream and one communication stream per device; inline on CPU."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda" and not torch.compiler.is_compiling()
        if self.enabled:
            self.compute = torch.cuda.current_stream(device)
            if device not in _COMM_STREAMS:
                _COMM_STREAMS[device] = torch.cuda.Stream(device=device)
            self.comm = _COMM_STREAMS[device]

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


def route_and_prepare(moe: torch.nn.Module, moe_input: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """moe_input (bs, slen, dim) -> (tokens (N, dim), the dispatcher's prepared input for `token_dispatch`)."""
    top_scores, selected_experts = moe.route(moe_input)
    tokens = moe_input.view(-1, moe_input.shape[-1])
    return tokens, moe.dispatcher.dispatch_preprocess(tokens, selected_experts, top_scores)


def moe_overlapped(
    moe: torch.nn.Module, streams: CommStreams, a: tuple[torch.Tensor, Any, Any], b: tuple[torch.Tensor, Any, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE rows of the module docstring's table for micro-batches a and b, each (tokens (N, dim), prepared
    (`route_and_prepare`), the `streams.mark()` event after it) -> each micro-batch's MoE output (N, dim)."""
    dispatcher = moe.dispatcher
    (tokens_a, prepared_a, routed_a), (tokens_b, prepared_b, routed_b) = a, b
    layout = moe.experts.row_layout(tokens_a.dtype)

    def experts(dispatched: Any) -> tuple[Any, Any]:
        expert_input, group_ends, state = dispatcher.dispatch_postprocess(dispatched, layout)
        return dispatcher.combine_preprocess(moe.experts(expert_input, group_ends), state), state

    def output(tokens: torch.Tensor, combined: Any, state: Any, shared: Any) -> torch.Tensor:
        return moe.sum_experts(dispatcher.combine_postprocess(combined, state), shared, tokens.dtype)

    dispatch_a = streams.communicate(routed_a, dispatcher.token_dispatch, prepared_a)
    shared_a = moe.run_shared_experts(tokens_a)
    to_combine_a, state_a = experts(streams.receive(dispatch_a))
    # issued after A's experts: a dispatch that waits on the host then finds A's experts already queued
    dispatch_b = streams.communicate(routed_b, dispatcher.token_dispatch, prepared_b)
    combine_a = streams.communicate(streams.mark(), dispatcher.token_combine, to_combine_a, state_a)
    to_combine_b, state_b = experts(streams.receive(dispatch_b))
    combine_b = streams.communicate(streams.mark(), dispatcher.token_combine, to_combine_b, state_b)

    out_a = output(tokens_a, streams.receive(combine_a), state_a, shared_a)
    shared_b = moe.run_shared_experts(tokens_b)
    out_b = output(tokens_b, streams.receive(combine_b), state_b, shared_b)
    return out_a, out_b


def forward_moe_block_overlapped(
    block: torch.nn.Module, xs: tuple[torch.Tensor, torch.Tensor], freqs_cis: torch.Tensor, masks: tuple[Any, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE `TransformerBlock` forward on micro-batches (A, B) in the schedule of the module docstring."""
    streams = CommStreams(xs[0].device)
    hs, routed = [], []
    for x, mask in zip(xs, masks, strict=True):
        h = x + block.attention(block.attention_norm(x), freqs_cis, mask)
        tokens, prepared = route_and_prepare(block.moe, block.ffn_norm(h))
        hs.append(h)
        routed.append((tokens, prepared, streams.mark()))
    out_a, out_b = moe_overlapped(block.moe, streams, *routed)
    return hs[0] + out_a.view(hs[0].shape), hs[1] + out_b.view(hs[1].shape)
