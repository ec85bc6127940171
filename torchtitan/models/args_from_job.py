"""What every model's `get_model_args` (`ModelSpec.model_args`) does alike: the args of the job's Hugging Face
config.json or else of its flavor, with the overrides every model takes. The model's `get_model_args` adds its own
(the sequence length's effect on RoPE, optional modules, what its parallelisms need of its shape)."""

import copy
from collections.abc import Callable
from typing import Any

from torchtitan.config import JobConfig

__all__ = ["args_from_job"]


def args_from_job(
    job_config: JobConfig,
    flavors: dict[str, Any],
    benchmark_flavors: dict[str, Any],
    load_hf_config: Callable[[str, str], tuple[dict[str, Any], Any]],
    model_flag: str = "",
) -> Any:
    """The args of `model.hf_config_path` (read by `load_hf_config`) if set, else a copy of `model.flavor` (one of
    `flavors` or `benchmark_flavors`; ValueError naming them, and `model_flag` where the model is not the default
    one), with debug.moe_force_load_balance and model.attn_mask_type (unless "flavor") set."""
    if job_config.model.hf_config_path:
        _, args = load_hf_config(job_config.model.hf_config_path, "--model.hf_config_path")
    else:
        flavor = job_config.model.flavor
        if flavor not in flavors and flavor not in benchmark_flavors:
            raise ValueError(
                f"unknown model.flavor {flavor!r}{f' for {model_flag}' if model_flag else ''}; choose one of "
                f"{sorted(flavors)} (benchmark shapes: {sorted(benchmark_flavors)})"
            )
        args = copy.deepcopy({**flavors, **benchmark_flavors}[flavor])
    args.moe_args.force_load_balance = job_config.debug.moe_force_load_balance
    if job_config.model.attn_mask_type != "flavor":
        args.attn_mask_type = job_config.model.attn_mask_type
    return args
