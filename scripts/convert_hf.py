"""Convert model weights between our DCP checkpoints and Hugging Face safetensors folders (single process, CPU).

    # our checkpoint (a full training checkpoint or a model-only export) -> HF folder with config.json, in bfloat16;
    # softmax routing (the debug model's) exports without its trained selection bias, which its HF type ignores
    python scripts/convert_hf.py to-hf outputs/checkpoint/step-1000 hf_out --flavor debugmodel --drop-selection-bias

    # ... or in the FP8 layout of DeepSeek's releases (linear layers' weights float8_e4m3fn, one scale per 128 x 128
    # block, config.json's quantization_config saying so)
    python scripts/convert_hf.py to-hf outputs/checkpoint/step-1000 hf_fp8 --flavor 671B --fp8-blocks

    # HF folder (DeepSeek-V2/V3 config.json + safetensors, bf16 or DeepSeek's FP8) -> model-only DCP checkpoint,
    # usable as --checkpoint.initial_load_path (keys "model.<name>", like the trainer's own checkpoints)
    python scripts/convert_hf.py from-hf path/to/DeepSeek-V2-Lite dcp_out

    # another model of models/spec.py's MODELS (deepseek_v3 unless given), as --model.name names it in training
    python scripts/convert_hf.py from-hf path/to/Qwen3-30B-A3B dcp_out --model qwen3_moe

    # a LoRA run's checkpoint (--lora.enable: adapters only) -> peft adapter folder (adapter_model.safetensors,
    # adapter_config.json) for PeftModel.from_pretrained(<transformers model of the base>, peft_out); --lora-alpha is
    # the run's --lora.alpha (not stored in the checkpoint; the rank comes from the adapters' shapes)
    python scripts/convert_hf.py to-peft outputs/checkpoint/step-1000 peft_out --hf-config base/config.json \
        --lora-alpha 32

    # ... or merged into its base (the run's --checkpoint.initial_load_path: a HF folder, whose config.json gives the
    # shape, or a DCP checkpoint with --flavor / --hf-config): W + alpha / r B A in float32, written as to-hf writes
    python scripts/convert_hf.py to-hf outputs/checkpoint/step-1000 hf_merged --lora-base path/to/DeepSeek-V3 \
        --lora-alpha 32 --fp8-blocks

The model shape comes from --flavor or --hf-config (a config.json); from-hf defaults to the folder's config.json.
Routed experts are stacked/unstacked and names mapped by the model's state-dict adapter. to-hf writes floating-point
tensors in --dtype (bfloat16 unless given; the router's selection bias stays float32). from-hf reads one tensor at a
time into the output (FP8 weights dequantized with their block scales, to float32) and writes each tensor as stored
unless --dtype is given; it holds the model once, in the output's dtypes. Nothing is written unless the output folder
is new (or empty) and can be made, every weight is finite and the tensors have the shape given; to-hf also checks the
checkpoint's files against their manifest (sizes and crc32, as a resume checks), and writes into
`<output>.incomplete-<pid>`, renamed to the output folder once complete (a killed to-hf leaves no output folder that
looks complete). Bad input, and a write that fails (a full disk, no permission), end with one `error:` line naming
the fix. A LoRA checkpoint is told by its model tensors, adapters only (models/moe/lora.py); to-peft writes them in
peft's layout for transformers >= 5 (models/moe/lora_export.py: the MLPs' and routed experts' adapters as
`target_parameters`; verified with peft 0.21), as stored (float32) unless --dtype is given.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from torchtitan.components.checkpoint_folder import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointError,
    checkpoint_keys,
    checkpoint_metadata,
    dcp_error_text,
    model_key_prefix,
    verify_checkpoint_files,
)
from torchtitan.components.hf_checkpoint import SCALE_SUFFIX, HFCheckpoint  # noqa: E402
from torchtitan.components.hf_safetensors import (  # noqa: E402
    export_bytes,
    export_write_problem,
    save_hf_safetensors,
    save_safetensors_file,
)
from torchtitan.config.job_config import LoRA  # noqa: E402
from torchtitan.kernels.float8_blocks import quantize_blocks  # noqa: E402
from torchtitan.models.moe.lora import add_adapters, is_adapter  # noqa: E402
from torchtitan.models.moe.lora_export import (  # noqa: E402
    PEFT_CONFIG_NAME,
    PEFT_WEIGHTS_NAME,
    lora_rank,
    lora_targets,
    merge_adapters,
    peft_config,
    to_peft,
)
from torchtitan.models.spec import MODELS, ModelArgs, ModelSpec, get_model_spec  # noqa: E402
from torchtitan.tools.cli import OneLineArgumentParser  # noqa: E402
from torchtitan.tools.dtypes import DTYPES  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-hf", "from-hf", "to-peft"])
    parser.add_argument("src", help="DCP checkpoint folder (to-hf, to-peft) or HF safetensors folder (from-hf)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3", help="the model (as --model.name)")
    parser.add_argument("--flavor", help="model shape preset (the model's flavors, as --model.flavor)")
    parser.add_argument("--hf-config", help="HF config.json giving the model shape (instead of --flavor)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="floating-point tensors in this dtype (to-hf: bfloat16 unless given; from-hf and to-peft: as stored "
        "unless given)",
    )
    parser.add_argument(
        "--fp8-blocks",
        nargs="?",
        const="128x128",
        metavar="ROWSxCOLS",
        help="to-hf: store the linear layers' weights as DeepSeek's FP8 releases do, float8_e4m3fn with one scale per "
        "block (128x128 unless given)",
    )
    parser.add_argument(
        "--drop-selection-bias",
        action="store_true",
        help="to-hf: export the routers without their selection bias, for a format that has none (DeepSeek's softmax "
        "routing: transformers' DeepseekV2; Qwen3-MoE): every reader then computes the model without it, which "
        "chooses other experts for some tokens than the model trained",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="to-hf: largest safetensors shard, e.g. 5GB")
    parser.add_argument(
        "--lora-base",
        metavar="BASE",
        help="to-hf of a LoRA checkpoint (its model tensors are adapters only): the base the adapters were trained on "
        "(the run's --checkpoint.initial_load_path, a HF folder or a DCP checkpoint), exported with them merged",
    )
    parser.add_argument(
        "--lora-alpha",
        type=float,
        metavar="ALPHA",
        help="to-peft, and to-hf of a LoRA checkpoint: the run's --lora.alpha (the adapters' scale is alpha / rank; a "
        "checkpoint holds the rank, not alpha)",
    )
    parser.add_argument(
        "--mtp-layers", type=int, help="multi-token prediction modules (as --model.mtp_layers; default: the shape's)"
    )
    opts = parser.parse_args(argv)
    spec = get_model_spec(opts.model)
    if opts.fp8_blocks and opts.direction == "from-hf":
        raise ValueError("--fp8-blocks is for to-hf: from-hf reads the block size from the folder's config.json")
    if opts.drop_selection_bias and opts.direction == "from-hf":
        raise ValueError(
            "--drop-selection-bias is for to-hf: from-hf reads the folder's selection bias (zeros without)"
        )
    if opts.direction == "from-hf" and (opts.lora_base or opts.lora_alpha is not None):
        raise ValueError(
            "--lora-base and --lora-alpha are for exporting a LoRA checkpoint (to-hf, to-peft): from-hf reads a whole "
            "model"
        )
    if opts.direction == "to-peft":
        for on, flag in [
            (opts.fp8_blocks, "--fp8-blocks"),
            (opts.drop_selection_bias, "--drop-selection-bias"),
            (opts.lora_base, "--lora-base"),
        ]:
            if on:
                raise ValueError(
                    f"{flag} is for to-hf: to-peft writes the adapters alone (to-hf --lora-base merges them into the "
                    "base)"
                )
    fp8_block = _block_size(opts.fp8_blocks) if opts.fp8_blocks else None

    if not os.path.isdir(opts.src):
        expected = "a HF folder (safetensors)" if opts.direction == "from-hf" else "a checkpoint's step-N folder"
        raise ValueError(f"{opts.src} is not a folder: give {expected}")
    if os.path.exists(opts.dst) and not (os.path.isdir(opts.dst) and not os.listdir(opts.dst)):
        # writing into it would overwrite files in place (a training checkpoint could no longer resume)
        raise ValueError(f"{opts.dst} exists and is not an empty folder: nothing was written; give a new output folder")
    lora = opts.direction != "from-hf" and _is_lora_checkpoint(opts.src)
    _check_lora_flags(opts, lora)
    _check_writable(opts.dst)
    config_path = opts.hf_config
    if config_path is None and opts.flavor is None and opts.direction == "from-hf":
        config_path = os.path.join(opts.src, "config.json")
        if os.path.isfile(os.path.join(opts.src, ".metadata")):
            raise ValueError(
                f"{opts.src} is a DCP checkpoint, not a Hugging Face folder: export it with to-hf, or train from it "
                "with --checkpoint.initial_load_path"
            )
        if not os.path.isfile(config_path):
            raise ValueError(f"{opts.src} has no config.json: give the model shape with --hf-config or --flavor")
    if config_path is None and opts.flavor is None and opts.lora_base and not _is_dcp(opts.lora_base):
        config_path = os.path.join(opts.lora_base, "config.json")  # the base's shape, which its adapters have
        if not os.path.isfile(config_path):
            raise ValueError(f"--lora-base {opts.lora_base} has no config.json: give the model shape with --hf-config")
    if opts.flavor is not None:
        if opts.flavor not in (flavors := spec.flavors()):
            raise ValueError(f"--flavor {opts.flavor} is no {opts.model} flavor: pass one of {sorted(flavors)}")
        args = copy.deepcopy(flavors[opts.flavor])
    elif config_path is not None:
        _, args = spec.hf_config_args(config_path, "--hf-config" if opts.hf_config else "config.json")
    else:
        raise ValueError(f"{opts.direction} needs --flavor or --hf-config to know the model shape")
    if opts.mtp_layers is not None and opts.mtp_layers < 0:
        raise ValueError(f"--mtp-layers {opts.mtp_layers}: pass 0 or more")
    if opts.mtp_layers is not None:
        args.mtp_layers = opts.mtp_layers
    elif opts.direction == "to-hf" and not lora and os.path.isfile(os.path.join(opts.src, ".metadata")):
        # the MTP modules the checkpoint holds, as the trainer builds them (a config may name ones it does not); a
        # LoRA checkpoint's are its base's (`read_base`)
        keys = checkpoint_keys(opts.src)
        prefix = model_key_prefix(keys)
        ours = {key.removeprefix(prefix) for key in keys}
        adapter = spec.state_dict_adapter(args)
        args = adapter.args_for_checkpoint(ours, opts.src, in_hf=False, requested=False, flag="--mtp-layers")

    dtype = DTYPES[opts.dtype] if opts.dtype else None
    if opts.direction == "to-hf":
        lora_base = (opts.lora_base, opts.lora_alpha, opts.mtp_layers is not None) if lora else None
        dcp_to_hf(
            spec,
            opts.src,
            opts.dst,
            args,
            dtype or torch.bfloat16,
            opts.max_shard_size,
            fp8_block,
            opts.drop_selection_bias,
            lora_base,
        )
    elif opts.direction == "to-peft":
        dcp_to_peft(spec, opts.src, opts.dst, args, opts.lora_alpha, dtype)
    else:
        hf_to_dcp(spec, opts.src, opts.dst, args, dtype, mtp_requested=opts.mtp_layers is not None)
    print(f"wrote {opts.dst}")


def _check_lora_flags(opts: argparse.Namespace, lora: bool) -> None:
    """A LoRA checkpoint (`lora`: its model tensors are adapters only) exports with --lora-alpha, merged into
    --lora-base by to-hf; a whole model takes neither flag, and to-peft takes only LoRA checkpoints."""
    src = opts.src
    if opts.direction == "to-peft" and not lora:
        raise ValueError(
            f"{src} holds no LoRA adapters (a whole model, or no DCP checkpoint): to-peft exports the checkpoint of a "
            "--lora.enable run; export this one with to-hf"
        )
    if opts.direction == "to-hf" and lora and not opts.lora_base:
        raise ValueError(
            f"{src} is a LoRA checkpoint (adapters only, no base weights): merge them into their base with --lora-base "
            "<the run's --checkpoint.initial_load_path> --lora-alpha <its --lora.alpha>, or export them alone with "
            "to-peft"
        )
    if not lora and (opts.lora_base or opts.lora_alpha is not None):
        flag = "--lora-base" if opts.lora_base else "--lora-alpha"
        raise ValueError(f"{flag} is for a LoRA checkpoint, and {src} holds a whole model: drop {flag}")
    if lora and opts.lora_alpha is None:
        raise ValueError(
            f"{src} is a LoRA checkpoint: pass --lora-alpha, the run's --lora.alpha (the adapters' scale is "
            "alpha / rank; the checkpoint holds the rank, not alpha)"
        )
    if opts.lora_base and not os.path.isdir(opts.lora_base):
        raise ValueError(
            f"--lora-base {opts.lora_base} is not a folder: give the base the adapters were trained on (the run's "
            "--checkpoint.initial_load_path, a HF folder or a DCP checkpoint)"
        )
    if opts.lora_base and _is_dcp(opts.lora_base) and _is_lora_checkpoint(opts.lora_base):
        raise ValueError(
            f"--lora-base {opts.lora_base} is a LoRA checkpoint too: give the base the adapters were trained on (the "
            "run's --checkpoint.initial_load_path)"
        )


def _is_dcp(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ".metadata"))


def _is_lora_checkpoint(folder: str) -> bool:
    """Whether the DCP checkpoint `folder` is a LoRA run's (`ModelWrapper`): its model tensors are adapters only.
    False for a folder that is no DCP checkpoint (reading it says why)."""
    if not _is_dcp(folder):
        return False
    keys = checkpoint_keys(folder, "convert an intact checkpoint (an older step-N)")
    prefix = model_key_prefix(keys)
    ours = [key.removeprefix(prefix) for key in keys if key.startswith(prefix)]
    return bool(ours) and all(map(is_adapter, ours))


def dcp_to_hf(
    spec: ModelSpec,
    src: str,
    dst: str,
    args: ModelArgs,
    dtype: torch.dtype,
    max_shard_size: int | str,
    fp8_block: tuple[int, int] | None = None,
    drop_selection_bias: bool = False,
    lora_base: tuple[str, float, bool] | None = None,
) -> None:
    """fp8_block: quantize the weights an FP8 release holds in FP8 (the adapter's `is_fp8_weight`: DeepSeek's
    choice), one scale per block of that many rows and columns, from the checkpoint's full-precision values.
    drop_selection_bias: export the routers without their selection bias (the adapter's `to_hf`). lora_base: `src`
    is a LoRA checkpoint, exported merged into its base: (the base's folder, HF or DCP; the run's lora.alpha; whether
    args.mtp_layers is the user's --mtp-layers), the base's own MTP modules otherwise."""
    if lora_base is None:
        state_dict = load_model_from_dcp(spec, src, args)
        _check_finite(state_dict, src)
    else:
        base, alpha, mtp_requested = lora_base
        adapters = load_adapters_from_dcp(spec, src, args, alpha)  # first: it is checked in a moment
        args, state_dict = read_base(spec, base, args, mtp_requested)
        state_dict = merge_adapters(state_dict, adapters, alpha)  # float32 where adapted; cast below
    adapter = spec.state_dict_adapter(args)
    hf_state_dict = {}
    for key, value in adapter.to_hf(state_dict, drop_selection_bias).items():
        if fp8_block is not None and adapter.is_fp8_weight(key):
            hf_state_dict[key], hf_state_dict[key + SCALE_SUFFIX] = quantize_blocks(value, fp8_block)
        elif value.is_floating_point() and not key.endswith("e_score_correction_bias"):  # fp32, as the model keeps it
            hf_state_dict[key] = value.to(dtype)
        else:
            hf_state_dict[key] = value
    config = adapter.hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if fp8_block is not None:  # as DeepSeek-V3's config.json says it
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(fp8_block),
        }
    with _export_folder(dst, src, export_bytes(hf_state_dict)) as folder:
        save_hf_safetensors(hf_state_dict, folder, max_shard_size=max_shard_size)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def hf_to_dcp(
    spec: ModelSpec, src: str, dst: str, args: ModelArgs, dtype: torch.dtype | None, mtp_requested: bool = False
) -> None:
    """mtp_requested: args.mtp_layers is the user's --mtp-layers (not the config's), so a checkpoint without MTP
    tensors gets freshly initialized MTP modules instead of none (the adapter's `args_for_checkpoint`)."""
    _, state_dict = load_model_from_hf(spec, src, args, dtype, mtp_requested)
    with _single_process_dcp():
        dcp.save({"model": state_dict}, checkpoint_id=dst, no_dist=True)


def dcp_to_peft(spec: ModelSpec, src: str, dst: str, args: ModelArgs, alpha: float, dtype: torch.dtype | None) -> None:
    """The adapters of the LoRA checkpoint `src` as a peft adapter folder (`lora_export.py`): adapter_model.safetensors
    (in `dtype`, as stored unless given) and adapter_config.json (rank from the shapes, lora_alpha `alpha`)."""
    adapters = load_adapters_from_dcp(spec, src, args, alpha)
    layout = spec.state_dict_adapter(args).layout
    tensors = {key: value.to(dtype or value.dtype) for key, value in to_peft(adapters, layout).items()}
    rank = lora_rank({name: tuple(value.shape) for name, value in adapters.items()})
    config = peft_config(adapters, layout, rank, alpha)
    with _export_folder(dst, src, export_bytes(tensors)) as folder:
        save_safetensors_file(tensors, os.path.join(folder, PEFT_WEIGHTS_NAME))
        with open(os.path.join(folder, PEFT_CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)


def read_base(spec: ModelSpec, base: str, args: ModelArgs, mtp_requested: bool) -> tuple[ModelArgs, dict]:
    """(args with the MTP modules `base` holds, its full state dict) of a LoRA run's base: a DCP checkpoint (ours, or
    from-hf's) or a HF folder. mtp_requested: as `hf_to_dcp`'s."""
    if not _is_dcp(base):
        return load_model_from_hf(spec, base, args, None, mtp_requested)
    keys = checkpoint_keys(base, "give an intact base as --lora-base")
    prefix = model_key_prefix(keys)
    ours = {key.removeprefix(prefix) for key in keys if key.startswith(prefix)}
    args = spec.state_dict_adapter(args).args_for_checkpoint(
        ours, base, in_hf=False, requested=mtp_requested, flag="--mtp-layers"
    )
    state_dict = load_model_from_dcp(spec, base, args)
    _check_finite(state_dict, base)
    return args, state_dict


def load_adapters_from_dcp(spec: ModelSpec, src: str, args: ModelArgs, alpha: float) -> dict[str, torch.Tensor]:
    """The adapters of the LoRA checkpoint `src` (its model tensors), once they are every adapter a run with their
    targets and rank (`lora_export.lora_targets` / `lora_rank` of their names and shapes) adds to the model of `args`,
    in its shapes."""
    metadata = checkpoint_metadata(src, "convert an intact checkpoint")
    prefix = model_key_prefix(metadata)
    shapes = {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    fix = "give the --flavor or --hf-config it was trained with"
    try:
        config = LoRA(enable=True, rank=lora_rank(shapes), alpha=alpha, targets=lora_targets(shapes))
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from None
    # the per-expert loop: grouped GEMMs' rank check is the trainer's; the adapters' shapes are the same
    args = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))
    with torch.device("meta"):
        model = spec.build(args)
    try:
        add_adapters(model, config, torch.float32)
    except ValueError:  # a rank larger than a target's dims: the adapters are another model's
        raise ValueError(f"{src}: adapters of rank {config.rank} do not fit this model shape: {fix}") from None
    expected = {name: param for name, param in model.named_parameters() if is_adapter(name)}
    adapters = load_model_from_dcp(spec, src, args, expected)
    _check_finite(adapters, src)
    return adapters


def load_model_from_hf(
    spec: ModelSpec, src: str, args: ModelArgs, dtype: torch.dtype | None, mtp_requested: bool = False
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(args with the MTP modules the HF folder `src` holds, or fresh ones if `mtp_requested`; our full state dict
    read from it, in `dtype` or as stored), as `hf_to_dcp` describes."""
    checkpoint = HFCheckpoint(src)
    args = spec.state_dict_adapter(args).args_for_checkpoint(
        checkpoint.keys(), src, in_hf=True, requested=mtp_requested, flag="--mtp-layers"
    )
    adapter = spec.state_dict_adapter(args)
    fix = "give the --flavor or --hf-config of the folder's model (its config.json by default)"
    try:
        sources = adapter.hf_sources(checkpoint.keys())
    except ValueError as err:  # names what differs from the shape given
        raise ValueError(f"{src}: {err}: {fix}") from None
    # the optional modules (DeepSeek-V3's MTP) the model builds and the folder holds none of start freshly initialized
    missing = [prefix for prefix in adapter.optional_prefixes if not any(key.startswith(prefix) for key in sources)]
    fresh = _fresh_modules(spec, args, missing)
    expected = _model_state(spec, args)
    if missing := sorted(set(expected) - set(sources) - set(fresh)):
        raise ValueError(f"{src} lacks {len(missing)} tensors of this model, e.g. {missing[:3]}; check the flavor")
    for name, shape in checkpoint.shapes(expected, sources).items():
        if name in expected and shape != expected[name].shape:
            raise ValueError(
                f"{src}: {name} is {tuple(shape)}, {tuple(expected[name].shape)} in the model shape given: {fix}"
            )
    if extra := sorted(set(sources) - set(expected)):
        raise ValueError(f"{src} holds {len(extra)} tensors the model shape given lacks, e.g. {extra[:3]}: {fix}")
    stored = checkpoint.dtypes(sources)  # zero-filled ones (no keys): float32, as the model keeps them
    layout = {name: torch.empty_like(expected[name], dtype=stored.get(name, torch.float32)) for name in sources}
    state_dict = {name: torch.empty_like(value, device="cpu") for name, value in _cast(layout, dtype).items()}
    checkpoint.read_into(state_dict, sources)  # each tensor straight into its output dtype
    state_dict.update(_cast(fresh, dtype))
    _check_finite(state_dict, src)
    return args, state_dict


def load_model_from_dcp(
    spec: ModelSpec, src: str, args: ModelArgs, expected: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint saved as {"model": ...} (keys "model.<name>") or at top level, once its
    files match its manifest (the trainer's checkpoints and exports have one) and its tensors the shape in `args`
    (`expected`, name -> a tensor of its shape, unless the model's whole state dict)."""
    _verify_files(src)
    metadata = checkpoint_metadata(src, "convert an intact checkpoint")
    prefix = model_key_prefix(metadata)
    found = {key.removeprefix(prefix): entry for key, entry in metadata.items() if key.startswith(prefix)}
    state_dict = {}
    fix = "give the --flavor or --hf-config (and --mtp-layers) it was trained with"
    for name, value in (_model_state(spec, args) if expected is None else expected).items():
        entry = found.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{src} has no tensor {prefix + name}: {fix}")
        if tuple(entry.size) != value.shape:
            raise ValueError(
                f"{src}: {prefix + name} is {tuple(entry.size)}, {tuple(value.shape)} in that shape: {fix}"
            )
        state_dict[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if extra := sorted(set(found) - set(state_dict)):
        raise ValueError(f"{src} holds {len(extra)} model tensors this shape lacks, e.g. {extra[:3]}: {fix}")
    try:
        with _single_process_dcp():
            dcp.load({"model": state_dict} if prefix else state_dict, checkpoint_id=src, no_dist=True)
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise CheckpointError(f"reading {src} failed ({dcp_error_text(err)}): convert an intact checkpoint") from err
    return state_dict


def _check_writable(dst: str) -> None:
    """The output folder can be made where it goes (not on a read-only disk, with permission, no file in the way):
    tried before anything is read, leaving nothing behind."""
    existing = os.path.abspath(dst)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as err:
        raise ValueError(
            f"cannot write {dst}: {existing} takes no new folder ({err.strerror}); give an output folder you can write"
        ) from None


@contextlib.contextmanager
def _export_folder(dst: str, src: str, needed: int) -> Iterator[str]:
    """A new folder beside `dst` to write the export into (`<dst>.incomplete-<pid>`), renamed to `dst` once complete:
    a killed export leaves that folder, never a `dst` that looks complete. A write that fails (a full disk, no
    permission) removes it and is one line; `needed`: the export's bytes."""
    tmp = f"{os.path.abspath(dst)}.incomplete-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        yield tmp
        os.rename(tmp, dst)  # over `dst` if it is an empty folder
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        problem = export_write_problem(dst, err, needed, "give another output folder")
        raise ValueError(f"exporting {src} failed, nothing was written ({src} is untouched): {problem}") from None
    except BaseException:  # an interrupt, or bad input found while writing
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _single_process_dcp():
    """DCP warns that torch.distributed is not initialized and it assumes one process: yes, on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _check_finite(state_dict: dict[str, torch.Tensor], src: str) -> None:
    """A weight holding inf or NaN is a corrupt or diverged checkpoint: refuse it rather than export it."""
    for name, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"{src}: {name} holds inf or NaN values; nothing was written: convert a checkpoint from before the "
                "run diverged (an older step-N)"
            )


def _verify_files(src: str) -> None:
    """Sizes and crc32 of every file against the manifest (as the trainer checks before a resume), before reading."""
    fix = "convert an intact checkpoint (an older step-N)"
    verify_checkpoint_files(src, fix, manifest_fix=f"Nothing was written; {fix}")
    if not os.path.isfile(os.path.join(src, ".metadata")) and not os.path.isfile(os.path.join(src, MANIFEST_NAME)):
        raise CheckpointError(f"{src} is not a DCP checkpoint (no .metadata): give a step-N folder of a checkpoint")


def _fresh_modules(spec: ModelSpec, args: ModelArgs, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """The state of the model's modules under `prefixes` (containers of blocks, e.g. DeepSeek-V3's `mtp.`),
    initialized as the trainer initializes them (seed 0: the output is reproducible), for a checkpoint that holds
    none of them."""
    if not prefixes:
        return {}
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(args)
    state_dict = {}
    for prefix in prefixes:
        for name, module in model.get_submodule(prefix.removesuffix(".")).named_children():
            module.to_empty(device="cpu")
            with torch.no_grad():
                module.init_weights(buffer_device="cpu")
            state_dict.update({f"{prefix}{name}.{key}": value for key, value in module.state_dict().items()})
    return state_dict


def _block_size(text: str) -> tuple[int, int]:
    """ "128x128" -> (128, 128)."""
    rows, _, cols = text.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
        raise ValueError(f"--fp8-blocks {text}: give the block's rows and columns, e.g. 128x128 (DeepSeek's)")
    return int(rows), int(cols)


def _model_state(spec: ModelSpec, args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return spec.build(args).state_dict()


def _cast(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state_dict
    # the expert bias and token counts stay fp32, as the model keeps them
    return {
        k: v.to(dtype) if v.is_floating_point() and not k.endswith(("expert_bias", "tokens_per_expert")) else v
        for k, v in state_dict.items()
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the notes on what is left out of the output
    try:
        main()
    except (CheckpointError, ValueError, OSError) as err:  # the input's fault: one line naming the fix
        sys.exit(f"error: {err}")
