"""torch.compile per transformer block (after activation checkpointing, before FSDP).

Dense blocks compile whole with fullgraph=True, their checkpoint included. MoE blocks compile their parts
(`CompiledParts`): the token exchange (`moe.dispatcher`) runs eager, since under EP its split sizes are copied to the
host and the routed experts may be their own FSDP2 unit, whose hooks are graph breaks. Between the exchanges the
routed experts (`GroupedExperts.run_routed`, per-op SAC's checkpoint inside) are one `CompiledRegion` shared by every
layer (`MoERegions`, created per model by `parallelize`), with dynamic token-row dims; so is the all-to-all
dispatcher's send buffer (`MoERegions.permutation`). Also compiled, on a fixed number of tokens: attention with its
norm and residual add (`attention_residual`, so they fuse), the router's selection, the shared experts, `ffn_input`
and `MoE.sum_experts` (a bare `torch.nn` module compiled as its own root frame is on dynamo's skip list, hence the
block method). A whole MoE block's checkpoint (full AC, or the budget's `full`) stays eager around the compiled
children. Modules are compiled in place, so parameter names do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch._dynamo.utils import counters, get_compilation_metrics

from torchtitan.distributed.expert_parallel.dispatcher import TokenPermutation
from torchtitan.distributed.utils import transformer_blocks, unwrapped_block
from torchtitan.kernels.permute import permute_to_experts, unpermute_tokens

__all__ = [
    "CompiledRegion",
    "MoERegions",
    "RecompiledDuringCheckpointError",
    "apply_compile",
    "Compiler",
    "CompiledParts",
    "graphs_compiled",
    "recompile_guard_contexts",
]


def apply_compile(model: nn.Module, backend: str, regions: MoERegions) -> None:
    """Compile each block of `model.layers` (and `model.mtp`) in place with `backend`; MoE blocks run `regions`."""
    # Token counts become Python ints in the expert-parallel dispatch; let dynamo capture them as unbacked symbols
    # instead of breaking the graph wherever such a count is read (process-wide: dynamo has no per-region setting).
    torch._dynamo.config.capture_scalar_outputs = True
    compiler = Compiler(backend)
    for block in transformer_blocks(model):
        inner = unwrapped_block(block)
        if any(isinstance(part, CompiledParts) and part.compile_parts(compiler, regions) for part in (inner, block)):
            continue  # the block, or its wrapper (a memory budget's: activation_checkpoint.py), compiled its parts
        compiler.module(block)  # whole, with its checkpoint wrapper: dynamo traces the checkpoint too


@dataclass(frozen=True)
class Compiler:
    """What a block that compiles its own parts is handed: compile one function (fullgraph), or one module in place
    (its parameter names unchanged)."""

    backend: str

    def function(self, fn: Callable) -> Callable:
        return torch.compile(fn, backend=self.backend, fullgraph=True)

    def module(self, module: nn.Module) -> None:
        module.compile(backend=self.backend, fullgraph=True)


@runtime_checkable
class CompiledParts(Protocol):
    """A block that may compile its parts itself instead of being compiled whole (an MoE block, module docstring):
    `compile_parts` compiles them with `compiler`, routes its routed experts through `regions` and returns True, or
    returns False to be compiled whole."""

    def compile_parts(self, compiler: Compiler, regions: MoERegions) -> bool: ...


class CompiledRegion:
    """A function compiled once for all MoE layers, whose token-row dims are dynamic from its first call.

    Every layer and step sees another number of token rows. With automatic dynamic shapes dynamo compiles a static
    graph at the first size and a dynamic one at the next; a checkpoint recompute of an earlier layer then runs the
    newer graph, which saves other tensors, and backward fails. Marked dynamic before every call (size-oblivious),
    the row dims give one graph for every row count. `token_dims` maps a positional argument's index to its row dim,
    or for a dataclass argument to {field: row dim} (None arguments and fields are skipped).
    """

    def __init__(self, fn: Callable, backend: str, token_dims: dict[int, int | dict[str, int]]):
        self.name = fn.__name__
        self.token_dims = token_dims
        self.num_graphs = 0
        self.graphs_in_checkpoints = 0  # compiled inside a whole MoE block's checkpoint (the recompile guard reads it)
        self.checkpoints_running = 0  # MoE checkpoints (forward or recompute) running now (the guard's contexts)
        self._compiled = torch.compile(fn, backend=backend, fullgraph=True)

    def __call__(self, *args: Any) -> Any:
        for index, dims in self.token_dims.items():
            if isinstance(dims, dict):
                for field, dim in dims.items():
                    if getattr(args[index], field) is not None:
                        torch._dynamo.mark_dynamic(getattr(args[index], field), dim)
            elif args[index] is not None:
                torch._dynamo.mark_dynamic(args[index], dims)
        before = graphs_compiled()
        with fx_config.patch(backed_size_oblivious=True):
            out = self._compiled(*args)
        compiled = graphs_compiled() - before
        self.num_graphs += compiled
        if self.checkpoints_running:
            self.graphs_in_checkpoints += compiled
        return out


@dataclass(frozen=True)
class MoERegions:
    """The compiled regions every MoE layer of one model shares: the routed experts and the all-to-all dispatcher's
    send buffer permutation. `parallelize` creates them once per model, before the expert-parallel styles."""

    permutation: TokenPermutation
    routed_experts: CompiledRegion

    @classmethod
    def build(cls, backend: str, routed_experts: Callable) -> MoERegions:
        """routed_experts: (tokens: ExpertTokens, w1, w2, w3, alignment, float8, float8_weights, recompute) ->
        (tokens, dim), `run_routed_experts`."""
        plan_dims = {"padded_slot": 0, "slot_row": 0}
        token_dims = {"x": 0, "order": 0, "weights": 0, "out_weights": 0}
        return cls(
            permutation=TokenPermutation(
                # (x (tokens, dim), order (slots,), counts, top_k, weights (tokens, top_k) | None, alignment, dtype)
                to_experts=CompiledRegion(permute_to_experts, backend, {0: 0, 1: 0, 4: 0}),
                # (rows (rows, dim), plan, top_k, weights (tokens, top_k) | None, dtype)
                from_experts=CompiledRegion(unpermute_tokens, backend, {0: 0, 1: plan_dims, 3: 0}),
            ),
            routed_experts=CompiledRegion(routed_experts, backend, {0: token_dims}),
        )

    def all(self) -> tuple[CompiledRegion, ...]:
        return (self.permutation.to_experts, self.permutation.from_experts, self.routed_experts)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (all frames): the trainer logs the per-step difference."""
    return counters["stats"]["unique_graphs"]


class RecompiledDuringCheckpointError(RuntimeError):
    """A compiled region compiled a new graph between a checkpointed block's forward and its recompute."""


def recompile_guard_contexts(
    block_name: str, regions: tuple[CompiledRegion, ...]
) -> tuple[contextlib.AbstractContextManager, ...]:
    """(forward, recompute) contexts for `torch.utils.checkpoint`'s `context_fn` of an MoE block: if a `CompiledRegion`
    compiled a graph after the block's forward, the recompute may run it and save other tensors; this raises one error
    naming the block, the region and dynamo's reason instead of a metadata mismatch deep in autograd.
    """
    forward_graphs: dict[str, int] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        with _checkpoint_running(regions):
            yield
        forward_graphs.update(_graphs_per_region(regions))

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        _check_no_recompile(block_name, regions, forward_graphs, "before")
        try:
            with _checkpoint_running(regions):
                yield
        finally:
            _check_no_recompile(block_name, regions, forward_graphs, "during")

    return forward(), recompute()


@contextlib.contextmanager
def _checkpoint_running(regions: tuple[CompiledRegion, ...]) -> Iterator[None]:
    for region in regions:
        region.checkpoints_running += 1
    try:
        yield
    finally:
        for region in regions:
            region.checkpoints_running -= 1


def _graphs_per_region(regions: tuple[CompiledRegion, ...]) -> dict[str, int]:
    return {region.name: region.graphs_in_checkpoints for region in regions}


def _check_no_recompile(
    block_name: str, regions: tuple[CompiledRegion, ...], forward_graphs: dict[str, int], when: str
) -> None:
    changed = [name for name, graphs in _graphs_per_region(regions).items() if graphs != forward_graphs.get(name, 0)]
    if not changed:
        return
    reasons = {m.co_name: m.recompile_reason for m in get_compilation_metrics() if m.co_name in changed}
    details = "; ".join(f"{name}: {reasons.get(name) or 'reason not recorded'}" for name in changed)
    raise RecompiledDuringCheckpointError(
        f"compiled MoE region(s) {', '.join(changed)} compiled a new graph {when} the activation-checkpoint "
        f"recompute of {block_name}, so the recompute could replay another graph than its forward ran "
        f"(dynamo's recompile reason: {details}). Find what changed between calls with TORCH_LOGS=recompiles, "
        "or train without --compile.enable or without activation checkpointing."
    )
