"""What the trainer and preflight need of a model, looked up by `model.name` (`get_model_spec`): its args for a job
(a `ModelArgs`), how to build, parallelize and pipeline it (into a `ParallelizedModel`), its Hugging Face state-dict
adapter, and the pipeline-split check preflight runs. A second model is one more `ModelSpec` in `MODELS`, the one list
of models (`model.name` takes any of its names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from torchtitan.components.checkpoint import StateDictAdapter
from torchtitan.config import ConfigError, JobConfig
from torchtitan.models.parallelized import ParallelizedModel

if TYPE_CHECKING:  # annotations only: the exchange's import loads torch._dynamo, which preflight puts off
    import torch

    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.moe.args import MoEArgs
    from torchtitan.models.moe.exchange import ExchangeBackend

__all__ = ["MODELS", "ModelArgs", "ModelSpec", "get_model_spec"]


@runtime_checkable
class ModelArgs(Protocol):
    """What the trainer and preflight read of a model's args; the rest is the model's own (its spec's functions take
    them whole)."""

    vocab_size: int
    dim: int
    """The hidden size: each token's width in the MoE layers' exchange."""
    n_layers: int
    n_heads: int
    max_seq_len: int
    moe_inter_dim: int
    """Hidden width of one routed expert (expert tensor parallelism splits it)."""
    moe_args: MoEArgs
    mtp_layers: int
    """Multi-token prediction modules (0: none)."""
    attn_mask_type: str
    """`causal`, or `block_causal` (the trainer passes document ids)."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(parameters of `model`, training FLOPs per token)."""
        ...


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_args: Callable[[JobConfig], ModelArgs]
    """job_config -> the model's args (its flavor or HF config, with the job's overrides); raises naming the fix."""
    build: Callable[[ModelArgs], nn.Module]
    """args -> the model, on the current device (the trainer builds it on meta)."""
    parallelize: Callable[[nn.Module, ParallelDims, JobConfig, ExchangeBackend], ParallelizedModel]
    """(model, parallel_dims, job_config, exchange) -> the model with every parallelism but the pipeline applied."""
    pipeline: Callable[
        [nn.Module, ParallelDims, JobConfig, ExchangeBackend, torch.device, ModelArgs, Callable], ParallelizedModel
    ]
    """(model, parallel_dims, job_config, exchange, device, args, loss_fn) -> this rank's stages, each parallelized,
    with their schedule."""
    state_dict_adapter: Callable[[ModelArgs], StateDictAdapter]
    """args -> the adapter between the model's state dict and Hugging Face's."""
    check_pipeline: Callable[[JobConfig, ParallelDims, ModelArgs], None]
    """(job_config, parallel_dims, args): raise where the pipeline split does not fit (preflight)."""
    stage_modules: Callable[[JobConfig, ParallelDims, ModelArgs], list[list[str]]]
    """(job_config, parallel_dims, args) -> the top-level module names of each pipeline stage, in stage order: the
    split `pipeline` makes (the plan counts each stage's parameters from it)."""


def _deepseek_v3() -> ModelSpec:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, get_model_args
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    def pipeline(*args: Any) -> ParallelizedModel:
        from torchtitan.models.deepseek_v3.pipeline import pipeline_deepseekv3

        return pipeline_deepseekv3(*args)

    def stage_modules(job_config: JobConfig, parallel_dims: ParallelDims, args: ModelArgs) -> list[list[str]]:
        from torchtitan.models.deepseek_v3.pipeline import module_names_per_stage, stages_per_rank

        stages = parallel_dims.pp * stages_per_rank(job_config.parallelism, parallel_dims.pp, args.n_layers)
        return module_names_per_stage(stages, args.n_layers, mtp_layers=args.mtp_layers)

    def check_pipeline(job_config: JobConfig, parallel_dims: ParallelDims, args: ModelArgs) -> None:
        stage_modules(job_config, parallel_dims, args)

    return ModelSpec(
        name="deepseek_v3",
        model_args=get_model_args,
        build=DeepSeekV3Model,
        parallelize=parallelize_deepseekv3,
        pipeline=pipeline,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        check_pipeline=check_pipeline,
        stage_modules=stage_modules,
    )


MODELS: dict[str, Callable[[], ModelSpec]] = {"deepseek_v3": _deepseek_v3}
"""Each model's spec, made when first looked up (the model's code is imported then, not before)."""


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a model here; pass one of {sorted(MODELS)}")
    return MODELS[name]()
