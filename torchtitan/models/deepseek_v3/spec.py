"""DeepSeek-V3's model spec (`models/spec.py`): its args, model, MLA's parallelize plan and Hugging Face interop; the
pipeline split is every MoE model's (`models/moe/pipeline.py`)."""

from functools import partial

from torchtitan.models.moe.pipeline import check_pipeline, pipeline_model, stage_modules
from torchtitan.models.spec import ModelSpec

from . import DeepSeekV3Model, DeepSeekV3StateDictAdapter, all_flavors, get_model_args
from .hf_config import load_hf_config
from .parallelize import parallelize_deepseekv3

__all__ = ["model_spec"]


def model_spec() -> ModelSpec:
    return ModelSpec(
        name="deepseek_v3",
        model_args=get_model_args,
        build=DeepSeekV3Model,
        parallelize=parallelize_deepseekv3,
        pipeline=partial(pipeline_model, parallelize=parallelize_deepseekv3),
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        flavors=all_flavors,
        hf_config_args=load_hf_config,
        check_pipeline=check_pipeline,
        stage_modules=stage_modules,
    )
