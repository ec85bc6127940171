"""The cheapest change that makes a job fit: every single change the trainer offers for memory is planned, and the
fitting one with the highest tokens/s/GPU wins; where none fits alone, the changes are combined, most memory saved
first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.plan.estimate import Plan
from torchtitan.plan.memory import GIB

__all__ = ["Change", "candidate_changes", "cheapest_fit"]


@dataclass(frozen=True)
class Change:
    what: str
    flags: tuple[str, ...]
    """CLI overrides (appended to the job's)."""
    nodes: int = 0
    """Nodes to add."""


def candidate_changes(plan: Plan) -> list[Change]:
    """The memory levers the job has not pulled yet."""
    job, dims = plan.job, plan.layout.dims
    ac, training, par = job.activation_checkpoint, job.training, job.parallelism
    changes = []
    if (
        job.optimizer.moments_dtype == "float32"
        and job.optimizer.name == "AdamW"
        and job.optimizer.implementation == "triton"
    ):
        changes.append(Change("bf16 Adam moments", ("--optimizer.moments_dtype", "bfloat16")))
    usable = int(plan.usable / GIB)
    if ac.mode == "selective" and str(ac.selective_ac_option) == "op":
        budget = ac.memory_budget_gib
        if budget <= 0 or budget > usable:
            changes.append(Change(f"a memory budget of {usable} GiB (recompute chosen per MoE block)",
                                  ("--activation_checkpoint.memory_budget_gib", str(usable))))  # fmt: skip
        elif budget > 0:
            lower = max(int(budget * 0.85), 1)
            changes.append(
                Change(f"a lower memory budget, {lower} GiB", ("--activation_checkpoint.memory_budget_gib", str(lower)))
            )
    if ac.mode != "full":
        flags = ("--activation_checkpoint.mode", "full", "--activation_checkpoint.memory_budget_gib", "0")
        changes.append(Change("full activation checkpointing", flags))
    if par.fsdp_reshard_after_forward != "always" and dims.fsdp_enabled:
        changes.append(Change("FSDP resharding after forward", ("--parallelism.fsdp_reshard_after_forward", "always")))
    if training.local_batch_size > 1 and dims.pp == 1:
        half = training.local_batch_size // 2
        changes.append(Change(f"local batch {half}", ("--training.local_batch_size", str(half))))
    args = plan.layout.args
    more_pp = dims.pp * 2
    if more_pp <= args.n_layers and dims.world_size % (more_pp * dims.tp * dims.cp * dims.dp_replicate) == 0:
        micro = max(training.local_batch_size, 2 * more_pp) if dims.pp == 1 else training.local_batch_size
        flags = [
            "--parallelism.pipeline_parallel_degree",
            str(more_pp),
            "--parallelism.data_parallel_shard_degree",
            "-1",
        ]
        if micro != training.local_batch_size:
            flags += ["--training.local_batch_size", str(micro)]
        changes.append(Change(f"pipeline parallel degree {more_pp}", tuple(flags)))
    if dims.fsdp_enabled and par.data_parallel_shard_degree == -1:
        changes.append(Change(f"twice the nodes ({2 * plan.nnodes})", (), nodes=plan.nnodes))
    return changes


def cheapest_fit(
    plan: Plan, replan: Callable[[Change], Plan | None], rounds: int = 3
) -> tuple[list[Change], Plan] | None:
    """The changes (one, else a combination) that fit with the highest tokens/s/GPU; None if none does.
    `replan(change)` plans the job with the change applied (None where the change is not a valid job)."""
    current, applied = plan, []
    for _ in range(rounds):
        options = []
        for change in candidate_changes(current):
            changed = replan(_combined(applied, change))
            if changed is not None:
                options.append((change, changed))
        fitting = [(c, p) for c, p in options if p.fits]
        if fitting:
            change, best = max(fitting, key=lambda option: option[1].tokens_per_sec_per_gpu)
            return [*applied, change], best
        if not options:
            return None
        change, current = min(options, key=lambda option: option[1].peak.total)
        applied.append(change)
    return None


def _combined(applied: list[Change], change: Change) -> Change:
    flags = tuple(flag for c in applied for flag in c.flags) + change.flags
    return Change(
        " + ".join([*(c.what for c in applied), change.what]), flags, sum(c.nodes for c in applied) + change.nodes
    )
