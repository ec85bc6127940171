"""What the trainer, preflight, the plan and the scripts need of a model, looked up by `model.name`
(`get_model_spec`): its args for a job (a `ModelArgs`) and its shape presets, how to build, parallelize and pipeline
it (into a `ParallelizedModel`), its Hugging Face config and state-dict adapter, and the pipeline split. A model is a
folder under `models/` whose `spec.py` has `model_spec()`, plus one line in `MODELS`, the one list of models
(`model.name` takes any of its names). What MoE transformers share (the MoE layer, the block, the order of the
parallelisms, the pipeline split) is `models/moe/`: a model's folder keeps its attention, its tensor-parallel plan
and its Hugging Face interop.
"""

from __future__ import annotations

import importlib
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

    # What the plan (`torchtitan/plan`) asks of the model's attention, beside the widths above
    qk_head_dim: int
    """Width of a query and key head: the attention's score matmul."""
    v_head_dim: int
    """Width of a value head: the attention's mix matmul."""
    inter_dim: int
    """Hidden width of the dense FFN of the model's dense layers."""

    def attention_activation_bytes(self, heads: int, cp: int) -> tuple[int, int]:
        """Bytes per token the attention keeps for its backward beyond its input and normed input, with `heads` query
        heads on this rank and its keys over `cp` ranks' tokens: (without recompute, under per-op SAC)."""
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
    flavors: Callable[[], dict[str, ModelArgs]]
    """The model's shape presets by name (`model.flavor`, the scripts' `--flavor`)."""
    hf_config_args: Callable[[str, str], tuple[dict[str, Any], ModelArgs]]
    """(path of a Hugging Face config.json, the flag that gave it) -> (the config, the args it gives); a file that is
    not one of this model's configs, or a value the model does not compute, is one error naming the flag."""
    check_pipeline: Callable[[JobConfig, ParallelDims, ModelArgs], None]
    """(job_config, parallel_dims, args): raise where the pipeline split does not fit (preflight)."""
    stage_modules: Callable[[JobConfig, ParallelDims, ModelArgs], list[list[str]]]
    """(job_config, parallel_dims, args) -> the top-level module names of each pipeline stage, in stage order: the
    split `pipeline` makes (the plan counts each stage's parameters from it)."""

    def build_on_meta(self, args: ModelArgs, job_config: JobConfig) -> nn.Module:
        """The model as the job trains it, on the meta device (the trainer materializes it after parallelizing; the
        plan counts it): with `lora.enable` its weights frozen in the compute dtype and adapters added."""
        import torch  # deferred like the model code: preflight imports this module before torch

        with torch.device("meta"):
            model = self.build(args)
        if job_config.lora.enable:
            from torchtitan.models.moe.lora import add_adapters
            from torchtitan.tools.dtypes import DTYPES

            add_adapters(model, job_config.lora, DTYPES[job_config.training.mixed_precision_param])
        return model


MODELS: dict[str, str] = {
    "deepseek_v3": "torchtitan.models.deepseek_v3.spec",
    "qwen3_moe": "torchtitan.models.qwen3_moe.spec",
}
"""Each model's name and the module whose `model_spec()` makes its spec: imported when first looked up (the model's
code is imported then, not before)."""


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a model here; pass one of {sorted(MODELS)}")
    return importlib.import_module(MODELS[name]).model_spec()
