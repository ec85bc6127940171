"""The cheapest change that makes a job fit: every change the trainer offers for memory is planned, and those that
fit are ranked by tokens/s/GPU (the cost of each to speed); where none fits alone, the changes are combined, the one
saving most memory first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.optimizer import keeps_bf16_moments
from torchtitan.plan.estimate import Plan
from torchtitan.plan.memory import GIB

__all__ = ["BUDGET_SAFETY", "Change", "candidate_changes", "fitting_changes"]

BUDGET_SAFETY = 0.95
"""A suggested memory budget leaves this share of what the allocator may reserve (the budget's own plan aims at the
budget after its 5% steady-state growth; the plan is accurate to 7%)."""


@dataclass(frozen=True)
class Change:
    what: str
    flags: tuple[str, ...] = ()
    """CLI overrides, appended to the job's."""
    nodes: int = 0
    """Nodes to add."""

    def then(self, other: Change) -> Change:
        return Change(f"{self.what} + {other.what}", self.flags + other.flags, self.nodes + other.nodes)


def candidate_changes(plan: Plan) -> list[Change]:
    """The memory levers the job has not pulled yet."""
    job, dims, args = plan.job, plan.layout.dims, plan.layout.args
    ac, training, par, optimizer = job.activation_checkpoint, job.training, job.parallelism, job.optimizer
    changes = []
    if optimizer.moments_dtype == "float32" and keeps_bf16_moments(job):
        changes.append(Change("bf16 Adam moments", ("--optimizer.moments_dtype", "bfloat16")))
    room = int((plan.usable - max(sum(m.outside_allocator.values()) for m in plan.memory)) * BUDGET_SAFETY / GIB)
    if ac.mode == "selective" and str(ac.selective_ac_option) == "op" and dims.pp == 1:
        budget = ac.memory_budget_gib
        target = room if budget <= 0 or budget > room else int(budget * 0.85)
        flags = ("--activation_checkpoint.memory_budget_gib", str(target))
        changes.append(Change(f"a memory budget of {target} GiB (each block's recompute chosen to fit)", flags))
    if ac.mode != "full":
        flags = ("--activation_checkpoint.mode", "full", "--activation_checkpoint.memory_budget_gib", "0")
        changes.append(Change("full activation checkpointing", flags))
    if par.fsdp_reshard_after_forward != "always" and dims.fsdp_enabled:
        changes.append(Change("FSDP resharding after forward", ("--parallelism.fsdp_reshard_after_forward", "always")))
    if training.local_batch_size > 1 and dims.pp == 1:
        half = training.local_batch_size // 2
        changes.append(Change(f"local batch {half}", ("--training.local_batch_size", str(half))))
    pp = 2 * dims.pp
    if pp <= args.n_layers and dims.world_size % (pp * dims.tp * dims.cp * dims.dp_replicate) == 0:
        flags = ["--parallelism.pipeline_parallel_degree", str(pp), "--parallelism.data_parallel_shard_degree", "-1"]
        flags += ["--activation_checkpoint.memory_budget_gib", "0"]  # the budget does not run with pipelining
        if training.local_batch_size < 2 * pp:  # enough micro-batches to fill the pipeline
            flags += ["--training.local_batch_size", str(2 * pp)]
        changes.append(Change(f"pipeline parallel degree {pp}", tuple(flags)))
    if dims.fsdp_enabled and par.data_parallel_shard_degree == -1:
        changes.append(Change(f"twice the nodes ({2 * plan.nnodes})", nodes=plan.nnodes))
    return changes


def fitting_changes(plan: Plan, replan: Callable[[Change], Plan | None], rounds: int = 3) -> list[tuple[Change, Plan]]:
    """The changes that fit, fastest first: single changes, else combinations of up to `rounds` (each round keeps
    the change that saved the most memory and tries the others on top). `replan(change)` plans the job with the
    change applied, None where that is not a valid job."""
    applied = Change("")
    current = plan
    for _ in range(rounds):
        options = []
        for change in candidate_changes(current):
            combined = applied.then(change) if applied.what else change
            changed = replan(combined)
            if changed is not None:
                options.append((combined, changed))
        fitting = sorted((o for o in options if o[1].fits), key=lambda o: -o[1].tokens_per_sec_per_gpu)
        if fitting or not options:
            return fitting
        applied, current = min(options, key=lambda o: o[1].peak.total)
    return []
