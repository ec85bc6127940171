"""Qwen3-MoE's model spec (`models/spec.py`): its args, model, the tensor-parallel plan of its attention and Hugging
Face interop; the pipeline split is every MoE model's (`models/moe/pipeline.py`)."""

from functools import partial

from torchtitan.models.moe.pipeline import check_pipeline, pipeline_model, stage_modules
from torchtitan.models.spec import ModelSpec

from . import Qwen3MoEModel, Qwen3MoEStateDictAdapter, all_flavors, get_model_args
from .hf_config import load_hf_config
from .parallelize import parallelize_qwen3_moe

__all__ = ["model_spec"]


def model_spec() -> ModelSpec:
    return ModelSpec(
        name="qwen3_moe",
        model_args=get_model_args,
        build=Qwen3MoEModel,
        parallelize=parallelize_qwen3_moe,
        pipeline=partial(pipeline_model, parallelize=parallelize_qwen3_moe),
        state_dict_adapter=Qwen3MoEStateDictAdapter,
        flavors=all_flavors,
        hf_config_args=load_hf_config,
        check_pipeline=check_pipeline,
        stage_modules=stage_modules,
    )
