"""A memory budget for activation checkpointing (`activation_checkpoint.memory_budget_gib`).

Each block under per-op SAC can run at one of three levels, from least memory (slowest) to most (fastest):

    full   the whole block recomputed in backward (an MoE block's exchange too): it keeps only its input
    sac    per-op SAC (the default; `activation_checkpoint.py`): on an MoE block's routed experts, a dense block whole
    none   no recompute: it keeps every activation (offered for MoE blocks only: a dense block's cost there is not
           measured)

The run's first step (or the first after a resume) runs every MoE block at `full` but the last, at `sac`, and the
dense blocks at `sac`: the least memory that still shows each level's cost (per-op SAC everywhere may not fit). Hooks
read the peak reserved memory and, per block, what its forward leaves allocated and the rows an MoE block's routed
experts computed, maximized over ranks (every rank must choose the same levels: a `full` MoE block exchanges tokens in
its recompute). `plan_levels` then picks `sac` everywhere if the predicted peak fits, then the last blocks to `none`
while it fits; else the first blocks (dense ones first: they come first) to `full` until it fits, so every block at
`full` is full activation checkpointing. The second step is measured and planned again (the model misses the
allocator's free blocks and first-step-only allocations such as the optimizer's moments); the allocator's cache is
released after each choice so one step's high-water mark does not carry into the next. The last MoE block's `sac`
measurement stands for every MoE block's, scaled by rows; `none` adds the routed experts' input rows and SwiGLU output,
rows x (dim + hidden) values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ActivationBudget", "BlockCost", "measuring_levels", "plan_levels"]

logger = logging.getLogger(__name__)

LEVELS = ("full", "sac", "none")
GIB = 1024**3
PLAN_MARGIN = 1.25
"""What a plan adds to the measured step counts this much above the estimate (what it frees counts as estimated):
the model misses the allocator's free blocks (benchmarks/NOTES.md, "Four H100s")."""
STEADY_GROWTH = 0.05
"""Later steps reserve up to this much more at the same levels: the allocator fragments and the routing grows less
even (benchmarks/NOTES.md, "Capacity-bounded sync-free dispatch")."""


@dataclass(frozen=True)
class BlockCost:
    """Bytes a block keeps from its forward to its backward at each level; `none` is None where that level is not
    offered (a dense block)."""

    full: float
    sac: float
    none: float | None


def plan_levels(
    budget: float, measured_peak: float, measured_levels: list[str], costs: list[BlockCost], margin: float = PLAN_MARGIN
) -> tuple[list[str], float]:
    """The levels of the blocks (in forward order) and their predicted peak: the fastest plan that fits `budget`
    bytes, from a step that reserved `measured_peak` at `measured_levels`. All `full` when nothing fits."""
    levels = ["sac"] * len(costs)

    def peak() -> float:
        """What the blocks hold at their highest (`_held_at_peak`) changes by what the plan holds there more than
        the measured step did (an increase times `margin`); the rest (weights, the loss, buffers) stays as measured."""
        change = _held_at_peak(costs, levels) - _held_at_peak(costs, measured_levels)
        return measured_peak + (change * margin if change > 0 else change)

    if peak() > budget:
        for i in range(len(costs)):
            levels[i] = "full"
            if peak() <= budget:
                break
        return levels, peak()
    for i in reversed(range(len(costs))):
        if costs[i].none is None:
            continue
        levels[i] = "none"
        if peak() > budget:
            levels[i] = "sac"
            break
    return levels, peak()


def _held_at_peak(costs: list[BlockCost], levels: list[str]) -> float:
    """What the blocks hold at the step's peak: at the end of the forward every block's kept bytes; a `full` block's
    backward re-creates all of its activations while the blocks before it still hold theirs (a dense block's `sac`
    bytes stand for them: it comes first, so its recompute falls where the other blocks have freed theirs)."""
    kept = [getattr(cost, level) for cost, level in zip(costs, levels, strict=True)]
    held = sum(kept)
    for i, (cost, level) in enumerate(zip(costs, levels, strict=True)):
        if level == "full":
            held = max(held, sum(kept[:i]) + (cost.none if cost.none is not None else cost.sac))
    return held


class ActivationBudget:
    """Measures the run's first step (hooks on the blocks, at `measuring_levels`), sets the blocks' levels after it
    and corrects them once after the next step (`after_step`).

    `blocks`: (its `SwitchableCheckpointWrapper`, block) per block under per-op SAC in forward order, as `apply_ac`
    returns them. The allocator functions are injectable for tests. The hooks run after FSDP's, so gathered weights
    do not count as kept.
    """

    def __init__(
        self,
        blocks: list[tuple[nn.Module, nn.Module]],
        budget_gib: float,
        memory_allocated: Callable[[], int] = torch.cuda.memory_allocated,
        max_memory_reserved: Callable[[], int] = torch.cuda.max_memory_reserved,
        release_cached: Callable[[], None] = torch.cuda.empty_cache,
    ):
        self.blocks = blocks
        self.budget = budget_gib * GIB
        self.memory_allocated = memory_allocated
        self.max_memory_reserved = max_memory_reserved
        self.release_cached = release_cached
        self.kept = [0.0] * len(blocks)
        self.output = [0.0] * len(blocks)
        self.recomputed = [0.0] * len(blocks)  # rows x (dim + hidden) x bytes of an MoE block's routed experts
        self._before = [0] * len(blocks)
        self.moe = [wrapper.recomputes_part for wrapper, _ in blocks]
        self.measuring_levels = measuring_levels(self.moe)
        self._set_levels(self.measuring_levels)
        self._hooks = []
        for i, (wrapper, block) in enumerate(blocks):
            self._hooks.append(wrapper.register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(wrapper.register_forward_hook(self._post_hook(i)))
            if self.moe[i]:
                self._hooks.append(block.moe.experts.register_forward_hook(self._experts_hook(i)))
        self.levels: list[str] | None = None
        self.predicted = 0.0  # the peak predicted for `levels`
        self.calibrated = False
        self._costs: list[BlockCost] = []

    def _pre_hook(self, i: int):
        def hook(module, args):
            self._before[i] = self.memory_allocated()

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            self.kept[i] = max(self.kept[i], self.memory_allocated() - self._before[i])
            self.output[i] = max(self.output[i], output.numel() * output.element_size())

        return hook

    def _experts_hook(self, i: int):
        def hook(module, args, output):
            tokens = args[0]  # ExpertTokens: the rows are its copies
            rows, dim = tokens.order.shape[0], tokens.x.shape[1]
            hidden = module.w1.shape[1]  # (experts, hidden, dim)
            self.recomputed[i] = max(self.recomputed[i], rows * (dim + hidden) * tokens.x.element_size())

        return hook

    def costs(self, kept: list[float], output: list[float], recomputed: list[float]) -> list[BlockCost]:
        """Each block's cost at each level from the measured step: `full` its output (the next block's input); a
        dense block's `sac` what it kept; an MoE block's `sac` what the last MoE block (measured there) kept, scaled by
        the rows each block computed, and `none` that plus what per-op SAC recomputes."""
        last_moe = _last_moe(self.moe)
        sac_kept, sac_rows = (kept[last_moe], recomputed[last_moe]) if last_moe is not None else (0.0, 0.0)
        costs = []
        for moe, out, block_kept, rows in zip(self.moe, output, kept, recomputed, strict=True):
            if not moe:
                costs.append(BlockCost(full=out, sac=block_kept, none=None))
                continue
            scaled = sac_kept * (max(1.0, rows / sac_rows) if sac_rows else 1.0)
            costs.append(BlockCost(full=out, sac=scaled, none=scaled + rows))
        return costs

    def after_step(self, device: torch.device) -> None:
        """After each of the run's first two steps (the trainer calls it until `calibrated`), before the step's
        metrics reset the allocator's peaks: the first chooses the levels, the second corrects them."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's peak is complete
        if self.levels is None:
            self._choose(device)
        else:
            self._recalibrate(device)

    def _choose(self, device: torch.device) -> None:
        """From the measuring step: the levels from the next step on (the same on every rank), applied and logged."""
        for hook in self._hooks:
            hook.remove()
        n = len(self.blocks)
        measured = _max_over_ranks([self.max_memory_reserved(), *self.kept, *self.output, *self.recomputed], device)
        measured_peak = measured[0]
        kept, output, recomputed = (measured[1 + k * n : 1 + (k + 1) * n] for k in range(3))
        self._costs = self.costs(kept, output, recomputed)
        self.levels, self.predicted = plan_levels(
            self.budget, measured_peak * (1 + STEADY_GROWTH), self.measuring_levels, self._costs
        )
        self._set_levels(self.levels)
        # the allocator keeps what it reserved, a high-water mark: released, the second step's peak is its own
        self.release_cached()
        self._log(
            f"the first step reserved {measured_peak / GIB:.1f} GiB (every MoE block recomputed whole but the last, "
            "the rest at per-op SAC)"
        )

    def _recalibrate(self, device: torch.device) -> None:
        """From the first step at the chosen levels: the levels again from this nearer measurement (which holds what
        the model misses: the allocator's free blocks, where in the step the peak falls), applied and logged."""
        (measured_peak,) = _max_over_ranks([self.max_memory_reserved()], device)
        levels, predicted = plan_levels(self.budget, measured_peak * (1 + STEADY_GROWTH), self.levels, self._costs)
        message = f"the second step reserved {measured_peak / GIB:.1f} GiB (predicted {self.predicted / GIB:.1f})"
        self.levels, self.predicted, self.calibrated = levels, predicted, True
        self._set_levels(levels)
        self.release_cached()
        self._log(message)

    def _log(self, measured: str) -> None:
        summary = ", ".join(f"{self.levels.count(level)} {level}" for level in LEVELS if level in self.levels)
        message = (
            f"activation_checkpoint.memory_budget_gib={self.budget / GIB:g}: {measured}; from the next step the "
            f"{len(self.blocks)} blocks ({sum(self.moe)} MoE) run {summary} (predicted peak "
            f"{self.predicted / GIB:.1f} GiB)"
        )
        if self.predicted > self.budget:
            logger.warning(message + ": above the budget even with full activation checkpointing")
        else:
            logger.info(message)

    def _set_levels(self, levels: list[str]) -> None:
        for (wrapper, block), level in zip(self.blocks, levels, strict=True):
            set_level(wrapper, block, level)


def measuring_levels(moe: list[bool]) -> list[str]:
    """The first step's levels of the blocks (True: an MoE block): every MoE block `full` but the last, the rest `sac`
    (module docstring)."""
    last_moe = _last_moe(moe)
    return ["full" if is_moe and i != last_moe else "sac" for i, is_moe in enumerate(moe)]


def _last_moe(moe: list[bool]) -> int | None:
    """The index of the last MoE block (its `sac` cost is measured in the first step), None without MoE blocks."""
    return max((i for i, is_moe in enumerate(moe) if is_moe), default=None)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    measured = torch.tensor([float(value) for value in values], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return measured.tolist()


def set_level(wrapper: nn.Module, block: nn.Module, level: str) -> None:
    """Run one block at `level` (module docstring) from its next forward on."""
    if level not in LEVELS:
        raise ValueError(f"activation checkpoint level {level!r}: use one of {LEVELS}")
    wrapper.level = level
    if wrapper.recomputes_part:
        block.recompute_part(level == "sac")
