"""DeepSeek-V3 model: args and flavors, the model, and Hugging Face interop."""

import logging
import os

from torchtitan.models.args_from_job import args_from_job

from .args import DeepSeekV3ModelArgs, benchmark_flavors, deepseekv3_flavors
from .hf_config import SELECTION_BIAS_IGNORED, load_hf_config, selection_bias_ignored_by_transformers
from .model import DeepSeekV3Model
from .state_dict_adapter import DeepSeekV3StateDictAdapter, mtp_layers_for_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "DeepSeekV3Model",
    "DeepSeekV3ModelArgs",
    "DeepSeekV3StateDictAdapter",
    "all_flavors",
    "benchmark_flavors",
    "deepseekv3_flavors",
    "get_model_args",
]


def get_model_args(job_config) -> DeepSeekV3ModelArgs:
    """Model args for a JobConfig: `model.hf_config_path` (a HF config.json) if set, else `model.flavor`, with the
    job's overrides. With an initial checkpoint that holds no MTP tensors, MTP is off unless model.mtp_layers asks for
    it (mtp_layers_for_checkpoint). ValueError for --checkpoint.last_save_in_hf of a softmax-routed model whose
    selection bias training moves (transformers would ignore it), before training rather than at its end."""
    args = args_from_job(job_config, deepseekv3_flavors, benchmark_flavors, load_hf_config)
    seq_len = job_config.training.seq_len
    if seq_len > args.max_seq_len:
        if args.max_seq_len <= args.original_seq_len < seq_len:
            logger.warning(
                f"training.seq_len={seq_len} exceeds the model's original context ({args.original_seq_len}): "
                f"max_seq_len is raised to {seq_len}, which turns on YaRN RoPE scaling (rope_factor "
                f"{args.rope_factor}); use a shorter --training.seq_len to train without it"
            )
        args.max_seq_len = seq_len
    if job_config.model.mtp_layers is not None:
        if job_config.model.mtp_layers < 0:
            raise ValueError(f"model.mtp_layers={job_config.model.mtp_layers}: use 0 (no MTP) or a positive depth")
        args.mtp_layers = job_config.model.mtp_layers
    checkpoint = job_config.checkpoint
    if checkpoint.enable and checkpoint.last_save_in_hf:
        _check_final_hf_export(args)
    keys = _initial_checkpoint_keys(checkpoint) if args.mtp_layers else None
    if keys is not None:
        args.mtp_layers = mtp_layers_for_checkpoint(
            args,
            keys,
            checkpoint.initial_load_path,
            in_hf=checkpoint.initial_load_in_hf,
            requested=job_config.model.mtp_layers is not None,
            flag="--model.mtp_layers",
        )
    return args


def _check_final_hf_export(args: DeepSeekV3ModelArgs) -> None:
    """A softmax-routed model whose selection bias training moves has no faithful HF export at the run's end."""
    trains_bias = args.moe_args.load_balance_coeff is not None and args.n_dense_layers < args.n_layers
    if trains_bias and selection_bias_ignored_by_transformers(args):
        raise ValueError(
            f"--checkpoint.last_save_in_hf: training moves the routers' selection bias (aux-loss-free balancing), but "
            f"{SELECTION_BIAS_IGNORED}: the export would compute other logits than the model trained. Drop the flag "
            "and export the final checkpoint without the bias, knowing that some tokens then choose other experts "
            "(scripts/convert_hf.py to-hf --drop-selection-bias), or train with sigmoid routing"
        )


def all_flavors() -> dict[str, DeepSeekV3ModelArgs]:
    """The models' flavors and the benchmarks' shapes, by name."""
    return {**deepseekv3_flavors, **benchmark_flavors}


def _initial_checkpoint_keys(checkpoint) -> set[str] | None:
    """The tensor names of the initial checkpoint: HF names, or the model's names in a DCP checkpoint (saved as
    {"model": ...} by the trainer and scripts/convert_hf.py, or at top level). None without one, or for a folder
    that is no DCP checkpoint (the checkpoint loader names the fix)."""
    path = checkpoint.initial_load_path
    if not path:
        return None
    if checkpoint.initial_load_in_hf:
        from torchtitan.components.hf_safetensors import hf_safetensors_keys

        return set(hf_safetensors_keys(path))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None
    from torchtitan.components.checkpoint_folder import checkpoint_keys, model_key_prefix

    keys = checkpoint_keys(path, "pass an intact one as --checkpoint.initial_load_path")
    prefix = model_key_prefix(keys)
    return {key.removeprefix(prefix) for key in keys if key.startswith(prefix)}
