"""Each block's activation checkpointing level (none, sac, full) under the job's `activation_checkpoint` settings,
and, with a memory budget, the levels the trainer's `ActivationBudget` would choose: its plan (`plan_levels`) run on
the peaks this plan predicts in place of the ones it measures in the first two steps."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.distributed.activation_budget import STEADY_GROWTH, BlockCost, measuring_levels, plan_levels
from torchtitan.plan.layout import Block, Layout
from torchtitan.plan.memory import ACTIVATION_SCALE, block_bytes_per_token

__all__ = ["Levels", "budget_levels", "configured_levels"]

Levels = list[list[str]]
"""Per stage of a rank, per block."""


def configured_levels(layout: Layout, rank: int) -> Levels:
    """The levels `apply_ac` gives the rank's blocks: per-op SAC is `sac` (an MoE block's routed experts, a dense block
    whole with its matmuls kept), a whole-block checkpoint `full`, no checkpoint `none`."""
    ac = layout.job.activation_checkpoint
    option = str(ac.selective_ac_option)
    levels = []
    for stage in layout.stages[rank]:
        stage_levels = []
        for block in stage.blocks:
            position = block.position
            selected = ac.num_blocks == -1 or position < ac.num_blocks
            if ac.mode == "none" or not selected:
                stage_levels.append("none")
            elif ac.mode == "full":
                stage_levels.append("full")
            elif option == "op":
                stage_levels.append("sac")
            else:
                stage_levels.append("full" if position % int(option) == 0 else "none")
        levels.append(stage_levels)
    return levels


def budget_levels(layout: Layout, rank: int, reserved: Callable[[Levels], float], budget_bytes: float) -> Levels:
    """The blocks' levels after the trainer's two planning steps (`ActivationBudget`, which switches every block under
    per-op SAC): the first step runs every MoE block `full` but the last and the rest `sac`, the plan from its peak;
    the second step runs that plan, the plan again from its peak. `reserved(levels)` is this plan's predicted reserved
    peak at those levels."""
    base = configured_levels(layout, rank)
    stages = layout.stages[rank]
    switched = [(s, b) for s, stage_levels in enumerate(base) for b, level in enumerate(stage_levels) if level == "sac"]
    if not switched or budget_bytes <= 0:
        return base
    costs = [_cost(layout, stages[s].blocks[b]) for s, b in switched]

    def with_levels(switched_levels: list[str]) -> Levels:
        levels = [list(stage_levels) for stage_levels in base]
        for (s, b), level in zip(switched, switched_levels, strict=True):
            levels[s][b] = level
        return levels

    measuring = measuring_levels([stages[s].blocks[b].moe for s, b in switched])
    chosen, _ = plan_levels(budget_bytes, reserved(with_levels(measuring)) * (1 + STEADY_GROWTH), measuring, costs)
    chosen, _ = plan_levels(budget_bytes, reserved(with_levels(chosen)) * (1 + STEADY_GROWTH), chosen, costs)
    return with_levels(chosen)


def _cost(layout: Layout, block: Block) -> BlockCost:
    """A block's kept bytes at each level, from the plan's per-token counts (what the budget measures with hooks);
    a dense block is not offered `none`, as in the trainer."""
    tokens = layout.microbatch_tokens * ACTIVATION_SCALE
    full, sac, none = (block_bytes_per_token(layout, block, level) * tokens for level in ("full", "sac", "none"))
    return BlockCost(full, sac, none if block.moe else None)
