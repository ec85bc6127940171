"""A job's plan: per GPU its memory by category and its step time by part, for a given cluster."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torchtitan.config import JobConfig
from torchtitan.plan.hardware import GPUS, NON_ALLOCATOR_GIB
from torchtitan.plan.layout import Layout, parameter_counts
from torchtitan.plan.levels import budget_levels, configured_levels
from torchtitan.plan.memory import GIB, RankMemory, rank_memory
from torchtitan.plan.speed import RankTime, rank_time
from torchtitan.preflight import CheckedJob, auto_memory_budget

__all__ = ["Plan", "plan_job"]


@dataclass
class Plan:
    job: JobConfig
    layout: Layout
    gpu: str
    nnodes: int
    memory: list[RankMemory]
    """Per pipeline rank."""
    time: list[RankTime]

    @property
    def world_size(self) -> int:
        return self.layout.dims.world_size

    @property
    def peak(self) -> RankMemory:
        """The pipeline rank with the largest use of its card."""
        return max(self.memory, key=lambda m: m.total)

    @property
    def usable(self) -> float:
        """Bytes of the card PyTorch's allocator can reserve: the card less the CUDA context, NCCL and workspaces."""
        return (GPUS[self.gpu].memory_gib - NON_ALLOCATOR_GIB) * GIB

    @property
    def fits(self) -> bool:
        return all(m.total <= self.usable for m in self.memory)

    @property
    def step_seconds(self) -> float:
        """The slowest pipeline rank sets the step."""
        return max(t.total for t in self.time)

    @property
    def tokens_per_step(self) -> int:
        training = self.job.training
        dp = self.layout.dims.dp_size
        return training.local_batch_size * training.seq_len * dp * self.layout.accumulation_steps

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        """As the trainer logs `tps`: the step's tokens per device per second."""
        return self.tokens_per_step / self.world_size / self.step_seconds

    @cached_property
    def counts(self) -> tuple[int, int, int, int, int]:
        """(parameters, active parameters, training FLOPs per token, both counts without MTP): the FLOPs by the
        trainer's formula (`get_nparams_and_flops`) on the model built on the meta device."""
        total, flops = self.layout.args.get_nparams_and_flops(self.layout.model, self.job.training.seq_len)
        _, active, without_mtp, active_without_mtp = parameter_counts(self.layout)
        return total, active, flops, without_mtp, active_without_mtp

    @property
    def mfu(self) -> float:
        return self.counts[2] * self.tokens_per_sec_per_gpu / (GPUS[self.gpu].bf16_tflops * 1e12)


def plan_job(checked: CheckedJob, gpus_per_node: int, gpu: str) -> Plan:
    """The plan of a validated job (`preflight.check_layout`) on nodes of `gpus_per_node` GPUs of kind `gpu`."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: plans are made for {', '.join(GPUS)}")
    job, dims = checked.config, checked.parallel_dims
    layout = Layout(checked.model_args, dims, job, gpus_per_node, checked.exchange, checked.spec)
    if job.activation_checkpoint.memory_budget_gib == "auto":  # what the trainer resolves it to on this card
        job.activation_checkpoint.memory_budget_gib, _ = auto_memory_budget(job, lambda: (gpu, GPUS[gpu].memory_gib))
    budget = job.activation_checkpoint.memory_budget_gib * GIB
    memory, time = [], []
    for rank in range(dims.pp):
        levels = configured_levels(layout, rank)
        if budget > 0 and job.activation_checkpoint.mode == "selective":
            levels = budget_levels(layout, rank, lambda lv, r=rank: rank_memory(layout, r, lv).reserved, budget)
        memory.append(rank_memory(layout, rank, levels))
        time.append(rank_time(layout, rank, levels, gpu))
    nnodes = -(-dims.world_size // gpus_per_node)
    return Plan(job, layout, gpu, nnodes, memory, time)
