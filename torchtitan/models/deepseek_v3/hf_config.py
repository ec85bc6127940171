"""Hugging Face DeepSeek-V2/V3 config.json <-> our model args.

`model_args_from_hf_config` reads every field that changes the model's math (shapes, norms, RoPE and YaRN, routing)
and refuses a value this model does not compute with one line naming the field and value. Fields of a training recipe
(aux_loss_alpha, seq_aux, initializer_range) or of inference (ep_size, quantization_config, use_cache) are accepted;
where one changes what a user expects, one log line says what training does instead. Fields no DeepSeek-V2/V3 config
defines are named in one warning line and ignored.

The published configs of DeepSeek-V2-Lite, Moonlight-16B-A3B, DeepSeek-V3 and Kimi K2 ship in `HF_CONFIGS`
(hf_configs/README.md says where each came from): `--model.hf_config_path <HF_CONFIGS>/deepseek_v3.json`.
"""

import logging
from pathlib import Path
from typing import Any

from torchtitan.models import hf_config_file
from torchtitan.models.hf_config_file import check_fixed, check_grouped_gemm_widths, check_positive_ints, rope_fields
from torchtitan.models.moe.args import MoEArgs

from .args import DeepSeekV3ModelArgs

logger = logging.getLogger(__name__)

HF_CONFIGS = Path(__file__).parent / "hf_configs"
"""The shipped config.json files: deepseek_v2_lite.json, moonlight_16b_a3b.json, deepseek_v3.json, kimi_k2.json."""

_SHAPE_KEYS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
    "n_routed_experts num_experts_per_tok kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim"
).split()
_FIXED: tuple[hf_config_file.Fixed, ...] = (
    *hf_config_file.FIXED_IN_EVERY_MODEL,
    ("mlp_bias", False, (False,), "no bias in FFN projections"),
    ("moe_layer_freq", 1, (1,), "an MoE in every layer after first_k_dense_replace"),
)
_ROUTING = {"scoring_func": ("sigmoid", "softmax"), "topk_method": ("noaux_tc", "greedy", "group_limited_greedy")}
# DeepSeek's own defaults where a config leaves a routing field out (transformers' classes fix them by model_type)
_ROUTING_DEFAULTS = {
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy"},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
# model_types whose config is another's math: Kimi K2 ships DeepSeek-V3's architecture (`architectures`:
# DeepseekV3ForCausalLM) under its own name
_SAME_MATH_AS = {"kimi_k2": "deepseek_v3"}
# DeepSeek's own fields (beside those of every family's config: `hf_config_file`)
_MATH_FIELDS = {
    *_SHAPE_KEYS,
    *(field for field, *_ in _FIXED),
    *_ROUTING,
    "num_key_value_heads",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "q_lora_rank",
    "rope_interleave",
    "num_nextn_predict_layers",
}
# Fields of a training recipe or of inference (each read below where it changes what a user expects), and metadata
_OTHER_FIELDS = {
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "auto_map",
    "pretraining_tp",
    "head_dim",  # transformers derives head_dim (= qk_rope_head_dim) and qk_head_dim, and ignores the file's
    "qk_head_dim",
}


def load_hf_config(path: str, flag: str) -> tuple[dict[str, Any], DeepSeekV3ModelArgs]:
    """The config.json at `path` (given by `flag`) and the model args it gives; a missing or malformed file, or one
    that is not a DeepSeek-V2/V3 config this model computes, is one error naming both."""
    return hf_config_file.load_hf_config(path, flag, model_args_from_hf_config, "DeepSeek-V2/V3")


def model_args_from_hf_config(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """Model args from a HF DeepSeek-V2/V3 config.json dict; ValueError (one line) for a value not computed here."""
    model_type = config.get("model_type", "deepseek_v3")
    model_type = _SAME_MATH_AS.get(model_type, model_type)
    if model_type not in _ROUTING_DEFAULTS:
        raise ValueError(
            f"model_type={model_type!r} is not supported (this model computes deepseek_v2, deepseek_v3 or kimi_k2)"
        )
    _check_shape(config)
    _check_computed_values(config, model_type)
    _log_what_training_does_instead(config)
    if unknown := hf_config_file.unknown_fields(config, _MATH_FIELDS | _OTHER_FIELDS):
        logger.warning(f"config.json fields that no DeepSeek-V2/V3 config defines, ignored: {unknown}")

    return DeepSeekV3ModelArgs(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        inter_dim=config["intermediate_size"],
        moe_inter_dim=config["moe_intermediate_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=config.get("first_k_dense_replace") or 0,
        n_heads=config["num_attention_heads"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        moe_args=_moe_args(config, model_type),
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        max_seq_len=config.get("max_position_embeddings", 4096),
        eos_id=hf_config_file.eos_id(config),
        mtp_layers=config.get("num_nextn_predict_layers") or 0,
        **_rope_args(config),
    )


def _moe_args(config: dict[str, Any], model_type: str) -> MoEArgs:
    """The router as DeepSeek's code computes it from scoring_func and topk_method: greedy is a plain top-k;
    group_limited_greedy (DeepSeek-V2) scores a group by its best affinity, noaux_tc (DeepSeek-V3) by the sum of its
    two best; groups of n_group == 1 are no groups."""
    routing = {key: config.get(key) or default for key, default in _ROUTING_DEFAULTS[model_type].items()}
    n_group = config.get("n_group") or 1
    grouped = routing["topk_method"] != "greedy" and n_group > 1
    return MoEArgs(
        num_experts=config["n_routed_experts"],
        num_shared_experts=config.get("n_shared_experts") or 0,
        top_k=config["num_experts_per_tok"],
        score_func=routing["scoring_func"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        num_expert_groups=n_group if grouped else None,
        num_limited_groups=(config.get("topk_group") or 1) if grouped else None,
        group_score="max" if routing["topk_method"] == "group_limited_greedy" else "top2_sum",
    )


def _rope_args(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the YaRN fields (rope_scaling, or transformers 5's rope_parameters) as model args. Without YaRN
    the whole context is the original one (YaRN stays off)."""
    rope, rope_type, theta = rope_fields(config)
    max_seq_len = config.get("max_position_embeddings", 4096)
    if rope_type == "default":
        return dict(rope_theta=theta, original_seq_len=max_seq_len)
    if rope_type != "yarn":
        raise ValueError(f"rope_scaling type={rope_type!r} is not supported (this model computes default or yarn)")
    for key, computed in (("attention_factor", None), ("truncate", True)):
        if rope.get(key, computed) != computed:
            raise ValueError(
                f"rope_scaling {key}={rope[key]!r} is not supported (this model computes YaRN with {key}={computed})"
            )
    original = rope["original_max_position_embeddings"]
    if max_seq_len <= original:
        raise ValueError(
            f"max_position_embeddings={max_seq_len} with YaRN is not supported (this model computes YaRN past "
            f"original_max_position_embeddings={original})"
        )
    return dict(
        rope_theta=theta,
        original_seq_len=original,
        rope_factor=float(rope.get("factor") or max_seq_len / original),
        beta_fast=rope.get("beta_fast") or 32,
        beta_slow=rope.get("beta_slow") or 1,
        # absent is 0, as in transformers: the cos/sin factor is then m(1), and without mscale_all_dim the softmax
        # scale stays as it is (rope.py)
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def _check_shape(config: dict[str, Any]) -> None:
    """The sizes a model is built from: positive whole numbers, and top-k among the routed experts."""
    check_positive_ints(config, _SHAPE_KEYS)
    for key in ("n_shared_experts", "first_k_dense_replace", "q_lora_rank", "num_nextn_predict_layers"):
        value = config.get(key) or 0
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key}={value!r} must be a whole number >= 0")
    top_k, experts = config["num_experts_per_tok"], config["n_routed_experts"]
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be at most n_routed_experts={experts}")
    if (config.get("first_k_dense_replace") or 0) > config["num_hidden_layers"]:
        raise ValueError(
            f"first_k_dense_replace={config['first_k_dense_replace']} must be at most "
            f"num_hidden_layers={config['num_hidden_layers']}"
        )
    groups, top_groups = config.get("n_group") or 1, config.get("topk_group") or 1
    if experts % groups or top_groups > groups:
        raise ValueError(
            f"n_group={groups} must divide n_routed_experts={experts}, and topk_group={top_groups} be at most n_group"
        )
    check_grouped_gemm_widths(config)


def _check_computed_values(config: dict[str, Any], model_type: str) -> None:
    """Each field with values this model does not compute: one ValueError naming the field, the value and ours."""
    check_fixed(config, _FIXED)
    for key, supported in _ROUTING.items():
        if key in config and config[key] not in supported:
            raise ValueError(f"{key}={config[key]!r} is not supported (this model computes {' or '.join(supported)})")
    heads = config.get("num_key_value_heads")
    if heads is not None and heads != config["num_attention_heads"]:
        raise ValueError(
            f"num_key_value_heads={heads!r} is not supported (this model computes MLA, whose keys and values have "
            f"num_attention_heads={config['num_attention_heads']} heads)"
        )
    if model_type == "deepseek_v3" and config.get("rope_interleave", True) is not True:
        raise ValueError(
            f"rope_interleave={config['rope_interleave']!r} is not supported (this model computes RoPE on interleaved "
            "pairs, the layout of DeepSeek's checkpoints)"
        )
    # DeepSeek-V2's code scales the routing weights only when it does not renormalize them; V3's (and ours) does both
    scale = config.get("routed_scaling_factor", 1.0)
    if model_type == "deepseek_v2" and config.get("norm_topk_prob") and scale != 1.0:
        raise ValueError(
            f"routed_scaling_factor={scale!r} with norm_topk_prob=true is not supported for deepseek_v2 (DeepSeek-V2 "
            "then leaves the renormalized weights unscaled; this model scales them)"
        )


def _log_what_training_does_instead(config: dict[str, Any]) -> None:
    """One log line for each recipe or inference field whose value a user may expect training to follow."""
    if alpha := config.get("aux_loss_alpha"):
        seq_aux = " sequence-wise" if config.get("seq_aux") else ""
        logger.info(
            f"aux_loss_alpha={alpha}: training adds no{seq_aux} auxiliary balance loss; it balances the experts "
            f"aux-loss-free, by each router's selection bias (load_balance_coeff {MoEArgs.load_balance_coeff})"
        )
    if (init := config.get("initializer_range", 0.02)) != 0.02:
        logger.info(f"initializer_range={init} is not used: fresh weights start as DeepSeekV3Model.init_weights sets")
    if (ep_size := config.get("ep_size", 1)) != 1:
        logger.info(f"ep_size={ep_size} is for inference: training's is --parallelism.expert_parallel_degree")
    if quantization := config.get("quantization_config"):
        logger.info(
            f"quantization_config ({quantization.get('quant_method')}) describes how the checkpoint stores its "
            "weights; training computes in --training.mixed_precision_param (and --quantize.float8_* where set)"
        )


def hf_config_from_model_args(args: DeepSeekV3ModelArgs) -> dict[str, Any]:
    """A HF config.json dict for these args (read back by `model_args_from_hf_config` to the same args): DeepseekV3
    for sigmoid routing, DeepseekV2 for softmax, with scoring_func and topk_method saying how the router computes."""
    m = args.moe_args
    sigmoid = m.score_func == "sigmoid"
    grouped = m.num_expert_groups is not None and m.num_expert_groups > 1
    if grouped:
        topk_method = "noaux_tc" if m.group_score == "top2_sum" else "group_limited_greedy"
    else:
        topk_method = "noaux_tc" if sigmoid else "greedy"
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "moe_layer_freq": 1,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "rms_norm_eps": args.norm_eps,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.num_shared_experts,
        "num_experts_per_tok": m.top_k,
        "scoring_func": m.score_func,
        "topk_method": topk_method,
        "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale,
        "n_group": m.num_expert_groups if grouped else 1,
        "topk_group": m.num_limited_groups if grouped else 1,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": args.eos_id,
        "num_nextn_predict_layers": args.mtp_layers,
        "torch_dtype": "float32",
    }
    if sigmoid:
        config["rope_interleave"] = True
    if args.max_seq_len > args.original_seq_len:
        config["rope_scaling"] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            "mscale": args.mscale,
            "mscale_all_dim": args.mscale_all_dim,
        }
    return config


SELECTION_BIAS_IGNORED = (
    "softmax routing exports as deepseek_v2, whose transformers code selects experts without the routers' selection "
    "bias (DeepSeek-V3's, which uses it, scores by sigmoid only)"
)
"""Why a softmax-routed model whose selection bias is not zero has no faithful Hugging Face export."""


def selection_bias_ignored_by_transformers(args: DeepSeekV3ModelArgs) -> bool:
    """Whether transformers' own class of the model type these args export as (`hf_config_from_model_args`) selects
    experts without the routers' selection bias (e_score_correction_bias): DeepseekV2's (softmax routing) has none,
    and DeepseekV3's, which has it, scores by sigmoid whatever scoring_func says."""
    return args.moe_args.score_func == "softmax"
