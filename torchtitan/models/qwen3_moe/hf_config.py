"""Hugging Face Qwen3-MoE config.json <-> our model args.

`model_args_from_hf_config` reads every field that changes the model's math (shapes, norms, RoPE, routing, which
layers are MoE) and refuses a value this model does not compute with one line naming the field and value. Fields of
a training recipe (router_aux_loss_coef, initializer_range) or of inference (use_cache, output_router_logits,
quantization_config) are accepted; where one changes what a user expects, one log line says what training does.
Fields no Qwen3-MoE config defines are named in one warning line and ignored.

The published configs of Qwen3-30B-A3B and Qwen3-235B-A22B ship in `HF_CONFIGS` (hf_configs/README.md says where each
came from): `--model.name qwen3_moe --model.hf_config_path <HF_CONFIGS>/qwen3_30b_a3b.json`.
"""

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchtitan.models import hf_config_file
from torchtitan.models.hf_config_file import check_fixed, check_grouped_gemm_widths, check_positive_ints, rope_fields

from .args import Qwen3MoEModelArgs, qwen3_moe_args

logger = logging.getLogger(__name__)

HF_CONFIGS = Path(__file__).parent / "hf_configs"
"""The shipped config.json files: qwen3_30b_a3b.json, qwen3_235b_a22b.json."""

_SHAPE_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads num_experts num_experts_per_tok"
).split()
_FIXED: tuple[hf_config_file.Fixed, ...] = (
    *hf_config_file.FIXED_IN_EVERY_MODEL,
    ("use_sliding_window", False, (False,), "full causal attention in every layer"),
)
# Qwen3-MoE's own fields (beside those of every family's config: `hf_config_file`)
_MATH_FIELDS = {
    *_SHAPE_KEYS,
    *(field for field, *_ in _FIXED),
    "num_local_experts",
    "head_dim",
    "decoder_sparse_step",
    "mlp_only_layers",
    "sliding_window",  # read by transformers only with use_sliding_window
    "max_window_layers",  # likewise
}
# A training recipe's field (logged below: what training does with it)
_OTHER_FIELDS = {"router_aux_loss_coef"}
_ROUTER_AUX_LOSS_COEF = 0.001
"""transformers' Qwen3MoeConfig default, where a config leaves router_aux_loss_coef out."""


def load_hf_config(path: str, flag: str) -> tuple[dict[str, Any], Qwen3MoEModelArgs]:
    """The config.json at `path` (given by `flag`) and the model args it gives; a missing or malformed file, or one
    that is not a Qwen3-MoE config this model computes, is one error naming both."""
    return hf_config_file.load_hf_config(path, flag, model_args_from_hf_config, "Qwen3-MoE")


def model_args_from_hf_config(config: dict[str, Any]) -> Qwen3MoEModelArgs:
    """Model args from a HF Qwen3-MoE config.json dict; ValueError (one line) for a value not computed here."""
    config = dict(config)
    model_type = config.get("model_type", "qwen3_moe")
    if model_type != "qwen3_moe":
        raise ValueError(
            f"model_type={model_type!r} is not supported (this model computes qwen3_moe; DeepSeek-V2/V3 and Kimi K2 "
            "are --model.name deepseek_v3)"
        )
    if "num_local_experts" in config:  # transformers 5 writes num_experts by this name (Qwen3MoeConfig.attribute_map)
        experts = config.setdefault("num_experts", config["num_local_experts"])
        if experts != config["num_local_experts"]:
            raise ValueError(f"num_experts={experts!r} and num_local_experts={config['num_local_experts']!r} differ")
    _check_shape(config)
    check_fixed(config, _FIXED)
    _log_what_training_does_instead(config)
    if unknown := hf_config_file.unknown_fields(config, _MATH_FIELDS | _OTHER_FIELDS):
        logger.warning(f"config.json fields that no Qwen3-MoE config defines, ignored: {unknown}")

    moe_args = replace(
        qwen3_moe_args(num_experts=config["num_experts"], top_k=config["num_experts_per_tok"]),
        route_norm=bool(config.get("norm_topk_prob", False)),  # transformers' default: False
        global_aux_loss_coeff=float(config.get("router_aux_loss_coef", _ROUTER_AUX_LOSS_COEF)),
    )
    return Qwen3MoEModelArgs(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        moe_inter_dim=config["moe_intermediate_size"],
        inter_dim=config["intermediate_size"],
        dense_layers=_dense_layers(config),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        moe_args=moe_args,
        max_seq_len=config.get("max_position_embeddings", 32768),
        rope_theta=_rope_theta(config),
        eos_id=hf_config_file.eos_id(config),
    )


def _dense_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """The layers transformers gives a dense MLP: those in mlp_only_layers and those decoder_sparse_step skips (layer
    i is sparse where (i + 1) % decoder_sparse_step == 0)."""
    step, mlp_only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
    return tuple(i for i in range(config["num_hidden_layers"]) if i in mlp_only or (i + 1) % step)


def _rope_theta(config: dict[str, Any]) -> float:
    """rope_theta of plain RoPE (rope_scaling null, or transformers 5's rope_parameters of type default)."""
    _, rope_type, theta = rope_fields(config)
    if rope_type != "default":
        raise ValueError(f"rope_scaling type={rope_type!r} is not supported (this model computes plain RoPE)")
    return theta


def _check_shape(config: dict[str, Any]) -> None:
    """The sizes a model is built from: positive whole numbers, heads in whole groups, top-k among the experts."""
    check_positive_ints(config, (*_SHAPE_KEYS, *(["head_dim"] if config.get("head_dim") is not None else [])))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    top_k, experts = config["num_experts_per_tok"], config["num_experts"]
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be at most num_experts={experts}")
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} must be a positive whole number")
    layers, mlp_only = config["num_hidden_layers"], config.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < layers for i in mlp_only):
        raise ValueError(f"mlp_only_layers={mlp_only!r} must list layers 0..{layers - 1}")
    check_grouped_gemm_widths(config)


def _log_what_training_does_instead(config: dict[str, Any]) -> None:
    """One log line for each recipe or inference field whose value a user may expect training to follow."""
    coef = config.get("router_aux_loss_coef", _ROUTER_AUX_LOSS_COEF)
    logger.info(
        f"router_aux_loss_coef={coef}: every MoE layer adds the global-batch balance loss at that weight, expert loads "
        "counted over the data-parallel ranks and the step's micro-batches (models/moe/load_balance.py); "
        "transformers pools the layers into one loss"
    )
    if (init := config.get("initializer_range", 0.02)) != 0.02:
        logger.info(f"initializer_range={init} is not used: fresh weights start as Qwen3MoEModel.init_weights sets")
    if quantization := config.get("quantization_config"):
        logger.info(
            f"quantization_config ({quantization.get('quant_method')}) describes how the checkpoint stores its "
            "weights; training computes in --training.mixed_precision_param (and --quantize.float8_* where set)"
        )


def hf_config_from_model_args(args: Qwen3MoEModelArgs) -> dict[str, Any]:
    """A HF config.json dict for these args (read back by `model_args_from_hf_config` to the same args)."""
    m = args.moe_args
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(args.dense_layers),
        "router_aux_loss_coef": m.global_aux_loss_coeff,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "eos_token_id": args.eos_id,
        "torch_dtype": "float32",
    }
