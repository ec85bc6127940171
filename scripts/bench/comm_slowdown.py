"""A communication-bound testbed: every token exchange of an MoE layer moves its payload `factor` times.

`SlowedDispatcher(inner, factor)` is a `TokenDispatcher` that runs `inner`'s stages; its two communication stages
(`token_dispatch`, `token_combine`) run `inner`'s stage once for the result and `factor - 1` more times on the same
inputs, results discarded, on the same stream. The exchange then costs about `factor` times as much while compute
stays the same, a stand-in for slow (inter-node) links on a machine that only has NVLink. Outputs and gradients are
those of `inner`. Benchmarking only (`scripts/bench/moe_layer.py --comm-slowdown`), built around the dispatcher the
expert-parallel style installed: `moe.dispatcher = SlowedDispatcher(moe.dispatcher, factor)`.

Backward: the backward of a dispatch is a combine and vice versa, and it must be slowed down too. The repeats run
with autograd on (on detached copies of the inputs), and the result's exchanged tensors pass through an identity
`autograd.Function` (`_RepeatInBackward`) whose backward sends the incoming gradient back through each repeat's
graph (`torch.autograd.grad`) before passing it on unchanged. A repeat whose output nobody uses would otherwise be
dropped by autograd; this way each backward exchange runs `factor` times with the real gradient as its payload.
Cost: each repeat's output stays alive until backward (one extra copy of the stage's output per repeat).

Activation checkpointing: the repeats keep their own saved tensors (checkpoint's hooks would recompute the region
again for each nested `torch.autograd.grad`, a new graph task), and the identity saves a marker after them so that a
recompute, which stops at the last saved tensor, runs the repeats too. Per-op SAC saves their outputs like the
stage's (communication is never recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchtitan.distributed.expert_parallel.dispatcher import DispatchState, ExpertTokens, TokenDispatcher
from torchtitan.tools.tensor_tree import map_tensors, tensors_in

__all__ = ["SlowedDispatcher"]


class SlowedDispatcher(TokenDispatcher):
    """`inner` with token_dispatch and token_combine (and their backwards) exchanging `factor` times (1: as is)."""

    def __init__(self, inner: TokenDispatcher, factor: int):
        if not isinstance(factor, int) or factor < 1:
            raise ValueError(f"comm slowdown factor must be an integer >= 1 (1 = off), got {factor!r}")
        super().__init__(inner.num_experts, inner.score_before_experts)
        self.backend = inner.backend
        self.inner = inner
        self.repeats = factor - 1

    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        return self.inner.dispatch_preprocess(x, topk_idx, topk_weights)

    def token_dispatch(self, prepared: Any) -> Any:
        return _repeated(self.inner.token_dispatch, self.repeats, prepared)

    def dispatch_postprocess(self, dispatched: Any) -> tuple[ExpertTokens, DispatchState | None]:
        return self.inner.dispatch_postprocess(dispatched)

    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState) -> Any:
        return self.inner.combine_preprocess(expert_output, state)

    def token_combine(self, prepared: Any, state: DispatchState) -> Any:
        return _repeated(self.inner.token_combine, self.repeats, prepared, state)

    def combine_postprocess(self, combined: Any, state: DispatchState) -> torch.Tensor:
        return self.inner.combine_postprocess(combined, state)


def _repeated(stage: Callable, repeats: int, *args: Any) -> Any:
    """stage(*args), plus `repeats` more calls on the same inputs whose forward and backward exchanges are real work."""
    result = stage(*args)
    exchanged = _exchanged_tensors(args, result)
    graphs = []
    for _ in range(repeats):
        repeat_args, leaves = _detached(args)
        # The repeat keeps what its backward needs itself: activation checkpointing's hooks would recompute the
        # whole checkpointed region again for each `torch.autograd.grad` of `_RepeatInBackward` (a new graph task).
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            repeat_result = stage(*repeat_args)
        if exchanged:
            graphs.append((_exchanged_tensors(repeat_args, repeat_result), leaves))
    if not graphs:  # factor 1, or no autograd (forward only, nothing differentiable): the repeats are done
        return result
    passed = dict(zip(map(id, exchanged), _RepeatInBackward.apply(graphs, *exchanged), strict=True))
    return map_tensors(result, lambda t: passed.get(id(t), t))


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _detached(args: Any) -> tuple[Any, list[torch.Tensor]]:
    """A repeat's inputs: `args` with every tensor that needs a gradient detached (so the repeat's backward stops at
    it instead of reaching the real graph) -> (the inputs, those detached leaves)."""
    leaves: list[torch.Tensor] = []

    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        leaves.append(tensor.detach().requires_grad_())
        return leaves[-1]

    return map_tensors(args, leaf), leaves


def _exchanged_tensors(args: Any, result: Any) -> list[torch.Tensor]:
    """The tensors of `result` that the stage produced with a gradient path (not inputs passed through, e.g. the
    dispatch state)."""
    inputs = {id(tensor) for tensor in tensors_in(args)}
    return [tensor for tensor in tensors_in(result) if tensor.requires_grad and id(tensor) not in inputs]


class _RepeatInBackward(torch.autograd.Function):
    """Identity on the stage's exchanged tensors; in backward, first runs each repeat's backward exchange on the same
    gradients (results discarded)."""

    @staticmethod
    def forward(ctx, graphs: list[tuple[list[torch.Tensor], list[torch.Tensor]]], *tensors: torch.Tensor):
        ctx.graphs = graphs
        # Saved after the repeats: a checkpointed region's recompute (which stops at the last saved tensor) then
        # runs the repeats too, as it runs the stage itself.
        ctx.save_for_backward(tensors[0].new_empty(0))
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        for outputs, leaves in ctx.graphs:
            torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
        return (None, *grads)
