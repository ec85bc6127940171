"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): args and flavors, the model, and Hugging Face interop."""

import logging

from torchtitan.models.args_from_job import args_from_job

from .args import Qwen3MoEModelArgs, benchmark_flavors, qwen3_moe_flavors
from .hf_config import load_hf_config
from .model import Qwen3MoEModel
from .state_dict_adapter import Qwen3MoEStateDictAdapter

logger = logging.getLogger(__name__)

__all__ = [
    "Qwen3MoEModel",
    "Qwen3MoEModelArgs",
    "Qwen3MoEStateDictAdapter",
    "all_flavors",
    "benchmark_flavors",
    "get_model_args",
    "qwen3_moe_flavors",
]


def get_model_args(job_config) -> Qwen3MoEModelArgs:
    """Model args for a JobConfig: `model.hf_config_path` (a HF config.json) if set, else `model.flavor`, with the
    job's overrides. ValueError naming the fix for what this model cannot do with the job: multi-token prediction,
    or key / value heads that tensor parallelism cannot split whole."""
    args = args_from_job(job_config, qwen3_moe_flavors, benchmark_flavors, load_hf_config, "--model.name qwen3_moe")
    if job_config.model.mtp_layers:
        raise ValueError(
            f"--model.mtp_layers {job_config.model.mtp_layers}: Qwen3-MoE has no multi-token prediction modules; "
            "drop the flag"
        )
    seq_len = job_config.training.seq_len
    if seq_len > args.max_seq_len:
        logger.warning(
            f"training.seq_len={seq_len} exceeds the model's max_seq_len ({args.max_seq_len}, "
            f"{job_config.model.shape_source()}): RoPE runs on past the positions the model was built for"
        )
        args.max_seq_len = seq_len
    tp = job_config.parallelism.tensor_parallel_degree
    if tp > 1 and args.n_kv_heads % tp:
        raise ValueError(
            f"n_kv_heads ({args.n_kv_heads}, {job_config.model.shape_source()}) is not divisible by "
            f"--parallelism.tensor_parallel_degree {tp}: tensor parallelism splits the key / value heads; use a "
            f"degree that divides {args.n_kv_heads}"
        )
    return args


def all_flavors() -> dict[str, Qwen3MoEModelArgs]:
    """The models' flavors and the benchmarks' shapes, by name."""
    return {**qwen3_moe_flavors, **benchmark_flavors}
