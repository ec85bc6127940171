"""Pipeline parallelism for any MoE transformer here: split the model into stages, parallelize each stage with the
model's own parallelize, build the schedule.

Stages get contiguous layers; the embedding and the norm+output head count as one layer each when balancing
(torchtitan's convention). Each stage is a deep copy of the whole model with the other layers deleted and missing
top-level modules set to None, so parameter names stay the full model's (checkpoints are stage-independent).

The model's layers are `layers` (a ModuleDict), its top-level parts `tok_embeddings`, `norm`, `output` and, with
multi-token prediction (DeepSeek-V3), `mtp`. The MTP modules run on the last stage, after the output head they share.
The first stage embeds their input tokens and sends them down with the hidden states (forward's `mtp_embeddings`): one
more (bs, seqlen, dim) activation per module per send, but a single copy of the embedding (no tied weights to sync,
count or save once).

The schedule backpropagates each micro-batch's loss separately, so gradients are the SUM over micro-batches
(`scale_grads=False`); the trainer's loss_fn divides by the step's global count of valid tokens, so the sum equals
the non-PP loss and gradient exactly.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import LossWithMTP
from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.exchange import ExchangeBackend
from torchtitan.models.parallelized import ParallelizedModel, Pipeline

__all__ = ["TrainingStage", "check_pipeline", "module_names_per_stage", "pipeline_model", "stage_modules"]

Parallelize = Callable[[nn.Module, ParallelDims, JobConfig, ExchangeBackend], ParallelizedModel]


class TrainingStage(PipelineStage):
    """A PipelineStage whose shape inference leaves no trace in training state: torch >= 2.13 runs every stage once on
    placeholder inputs, which would count tokens into the expert-bias balancing and loss into the logged MTP loss; the
    stage's buffers and the loss's running totals are put back as they were.
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        with _restored(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with _restored(self.submod, kwargs.get("loss_fn")):
            return super()._backward_metadata_inference(*args, **kwargs)


@contextlib.contextmanager
def _restored(module: nn.Module, loss_fn: Callable | None = None) -> Iterator[None]:
    local = [buffer.to_local() if isinstance(buffer, DTensor) else buffer for buffer in module.buffers()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in local]
    totals = (loss_fn.main_total, loss_fn.mtp_total) if isinstance(loss_fn, LossWithMTP) else None
    yield
    with torch.no_grad():
        for buffer, saved in buffers:
            if not torch.equal(buffer, saved):  # untouched ones (freqs_cis) may be saved for the backward
                buffer.copy_(saved)
    if totals is not None:
        loss_fn.main_total, loss_fn.mtp_total = totals


def pipeline_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    exchange: ExchangeBackend,
    device: torch.device,
    model_args: Any,
    loss_fn: Callable,
    *,
    parallelize: Parallelize,
) -> ParallelizedModel:
    """This rank's stages, each parallelized by the model's `parallelize`, and their schedule (a model spec's
    `pipeline`). `model` may be on the meta device (initialize each part afterwards) or initialized (its weights are
    copied into the stages)."""
    parallelism = job_config.parallelism
    pp_mesh = parallel_dims.get_mesh("pp")
    schedule_class = get_schedule_class(parallelism.pipeline_parallel_schedule)
    per_rank = stages_per_rank(parallelism, parallel_dims.pp, model_args.n_layers)
    num_stages = parallel_dims.pp * per_rank
    names_per_stage = module_names_per_stage(num_stages, model_args.n_layers, mtp_layers=model_args.mtp_layers)

    # preflight.check_batch_sizes: local_batch_size is a multiple of the micro-batch size
    n_microbatches = job_config.training.local_batch_size // parallelism.pipeline_parallel_microbatch_size

    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):  # V style: rank r holds r and 2 pp - 1 - r
        stage_ids = [pp_rank, 2 * pp_size - 1 - pp_rank]
    else:  # loop style: r, r + pp, ...
        stage_ids = [pp_rank + i * pp_size for i in range(per_rank)]

    stages, parallelized = [], []
    for stage_id in stage_ids:
        part = parallelize(_split(model, names_per_stage[stage_id]), parallel_dims, job_config, exchange)
        parallelized.append(part)
        stages.append(TrainingStage(part.model, stage_id, num_stages, device, group=pp_mesh.get_group()))

    schedule = schedule_class(
        stages if issubclass(schedule_class, PipelineScheduleMulti) else stages[0],
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
    has_first, has_last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
    return ParallelizedModel.of_stages(parallelized, Pipeline(schedule, has_first, has_last, n_microbatches))


def stage_modules(job_config: JobConfig, parallel_dims: ParallelDims, model_args: Any) -> list[list[str]]:
    """The top-level module names of each pipeline stage, in stage order: the split `pipeline_model` makes (a model
    spec's `stage_modules`); raises naming the fix where the split does not fit."""
    per_rank = stages_per_rank(job_config.parallelism, parallel_dims.pp, model_args.n_layers)
    return module_names_per_stage(parallel_dims.pp * per_rank, model_args.n_layers, mtp_layers=model_args.mtp_layers)


def check_pipeline(job_config: JobConfig, parallel_dims: ParallelDims, model_args: Any) -> None:
    """Raise naming the fix where the pipeline split does not fit (a model spec's `check_pipeline`, preflight's)."""
    stage_modules(job_config, parallel_dims, model_args)


def stages_per_rank(parallelism: Any, pp_degree: int, num_layers: int) -> int:
    """Pipeline stages per rank for the schedule and `pipeline_parallel_layers_per_stage` (the layers, the embedding
    and the head counted as layers); raises naming the fix where they do not fit. Preflight calls it too."""
    schedule = parallelism.pipeline_parallel_schedule
    single_stage = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is None:
        return 1 if single_stage else 2
    num_stages = math.ceil((num_layers + 2) / layers_per_stage)
    if num_stages % pp_degree != 0:
        raise ValueError(
            f"pipeline_parallel_layers_per_stage={layers_per_stage} gives {num_stages} stages (n_layers {num_layers} + "
            f"embedding + head), not divisible by pipeline_parallel_degree {pp_degree}; choose another "
            "layers_per_stage."
        )
    per_rank = num_stages // pp_degree
    if single_stage and per_rank != 1:
        raise ValueError(
            f"schedule {schedule} runs one stage per rank but pipeline_parallel_layers_per_stage gives {per_rank}; "
            "raise layers_per_stage or use an interleaved schedule."
        )
    if not single_stage and per_rank < 2:
        raise ValueError(f"schedule {schedule} needs >= 2 stages per rank; lower pipeline_parallel_layers_per_stage.")
    return per_rank


def module_names_per_stage(num_stages: int, num_layers: int, mtp_layers: int = 0) -> list[list[str]]:
    """Top-level module names of each stage, balancing layer counts with the embedding and the head weighted as one
    layer each. MTP modules go on the last stage, each weighted as two layers (its block, another head pass).

    >>> module_names_per_stage(2, 4)
    [['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']]
    """
    effective = num_layers + 1 + 1 + 2 * mtp_layers
    if num_stages > effective or num_stages < 1:
        raise ValueError(f"{num_stages} pipeline stages for {num_layers} layers: every stage needs a layer.")
    base, extra = divmod(effective, num_stages)
    names, next_layer = [], 0
    for stage in range(num_stages):
        budget = base + (1 if stage < extra else 0)
        stage_names = []
        if stage == 0:
            stage_names.append("tok_embeddings")
            budget -= 1
        if stage == num_stages - 1:
            budget = num_layers - next_layer  # the last stage takes whatever is left
        for _ in range(max(budget, 0)):
            if next_layer < num_layers:
                stage_names.append(f"layers.{next_layer}")
                next_layer += 1
        if stage == num_stages - 1:
            stage_names += ["norm", "output"] + (["mtp"] if mtp_layers else [])
        if not any(n.startswith("layers.") for n in stage_names) and 0 < stage < num_stages - 1:
            raise ValueError(f"pipeline stage {stage} of {num_stages} would have no layer; use fewer stages.")
        names.append(stage_names)
    return names


def _split(model: nn.Module, keep: list[str]) -> nn.Module:
    part = copy.deepcopy(model)
    keep_layers = {name.split(".", 1)[1] for name in keep if name.startswith("layers.")}
    for layer_name in list(part.layers.keys()):
        if layer_name not in keep_layers:
            del part.layers[layer_name]
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(part, name, None)
    if "mtp" not in keep and hasattr(part, "mtp"):
        part.mtp = nn.ModuleDict()
    return part
