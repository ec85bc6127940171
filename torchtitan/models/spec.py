"""What the trainer and preflight need of a model, looked up by `model.name` (`get_model_spec`): its args for a job,
how to build, parallelize and pipeline it (into a `ParallelizedModel`), its Hugging Face state-dict adapter, and the
pipeline-split check preflight runs. A second model is one more `ModelSpec` in `MODELS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan.components.checkpoint import StateDictAdapter
from torchtitan.config import ConfigError
from torchtitan.models.parallelized import ParallelizedModel

__all__ = ["MODELS", "ModelSpec", "get_model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_args: Callable[[Any], Any]
    """job_config -> the model's args (its flavor or HF config, with the job's overrides); raises naming the fix."""
    build: Callable[[Any], nn.Module]
    """args -> the model, on the current device (the trainer builds it on meta)."""
    parallelize: Callable[[nn.Module, Any, Any, Any], ParallelizedModel]
    """(model, parallel_dims, job_config, exchange backend) -> the model with every parallelism but the pipeline
    applied."""
    pipeline: Callable[..., ParallelizedModel]
    """(model, parallel_dims, job_config, exchange backend, device, args, loss_fn) -> this rank's stages, each
    parallelized, with their schedule."""
    state_dict_adapter: Callable[[Any], StateDictAdapter]
    """args -> the adapter between the model's state dict and Hugging Face's."""
    check_pipeline: Callable[[Any, Any, Any], None]
    """(job_config, parallel_dims, args): raise where the pipeline split does not fit (preflight)."""


def _deepseek_v3() -> ModelSpec:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, get_model_args
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    def pipeline(*args: Any) -> ParallelizedModel:
        from torchtitan.models.deepseek_v3.pipeline import pipeline_deepseekv3

        return pipeline_deepseekv3(*args)

    def check_pipeline(job_config: Any, parallel_dims: Any, args: Any) -> None:
        from torchtitan.models.deepseek_v3.pipeline import module_names_per_stage, stages_per_rank

        stages = parallel_dims.pp * stages_per_rank(job_config.parallelism, parallel_dims.pp, args.n_layers)
        module_names_per_stage(stages, args.n_layers, mtp_layers=args.mtp_layers)

    return ModelSpec(
        name="deepseek_v3",
        model_args=get_model_args,
        build=DeepSeekV3Model,
        parallelize=parallelize_deepseekv3,
        pipeline=pipeline,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        check_pipeline=check_pipeline,
    )


MODELS: dict[str, Callable[[], ModelSpec]] = {"deepseek_v3": _deepseek_v3}
"""Each model's spec, made when first looked up (the model's code is imported then, not before)."""


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a model here; pass one of {sorted(MODELS)}")
    return MODELS[name]()
