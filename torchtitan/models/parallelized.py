"""What a model spec's `parallelize` or `pipeline` made of a model: its parts, and the choices made on the way that
the trainer follows instead of deriving them again (`models/spec.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from torchtitan.distributed.activation_checkpoint import SwitchableCheckpointWrapper
from torchtitan.distributed.context_parallel import ContextParallel

__all__ = ["ParallelizedModel", "Pipeline"]


@dataclass
class ParallelizedModel:
    parts: list[nn.Module]
    """The model, or this rank's pipeline stages (each a copy of the model that holds some of its layers)."""
    experts_outside_fsdp: bool
    """FSDP leaves the routed experts alone (`models/moe/parallelize.py`'s `experts_outside_fsdp`): under bf16 the
    trainer stores them in bf16 with fp32 masters, since no FSDP unit casts them."""
    context_parallel: ContextParallel | None = None
    """The CP group's positions and latent gather the model runs with; None without context parallelism."""
    budget_blocks: list[tuple[SwitchableCheckpointWrapper, nn.Module]] = field(default_factory=list)
    """(switchable checkpoint wrapper, MoE block) of each MoE block whose level a memory budget sets, in forward order,
    as activation checkpointing wrapped them (`apply_ac`); empty without a budget."""
    pipeline: Pipeline | None = None
    """This rank's part of the pipeline schedule; None without pipeline parallelism."""

    @property
    def model(self) -> nn.Module:
        """The model, where it is one part (no pipeline)."""
        (model,) = self.parts
        return model

    @classmethod
    def of_stages(cls, stages: list[ParallelizedModel], pipeline: Pipeline) -> ParallelizedModel:
        """This rank's pipeline stages, each parallelized alike, as one model in several parts."""
        return replace(
            stages[0],
            parts=[part for stage in stages for part in stage.parts],
            budget_blocks=[block for stage in stages for block in stage.budget_blocks],
            pipeline=pipeline,
        )


@dataclass(frozen=True)
class Pipeline:
    schedule: Any
    """torch.distributed.pipelining's schedule over this rank's stages."""
    has_first_stage: bool
    has_last_stage: bool
    microbatches: int
    """Micro-batches the schedule runs per step, each a backward that adds to the gradients."""
