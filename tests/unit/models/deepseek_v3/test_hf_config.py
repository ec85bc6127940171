"""The shipped published configs (hf_configs/) parse into exactly the model args of their models; a value the model
does not compute is one line naming the field and value; recipe and inference fields are accepted, with one log line
where training does something else; parameter counts are transformers' own."""

import dataclasses
import json
import logging

import pytest
import torch

from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, deepseekv3_flavors
from torchtitan.models.deepseek_v3.hf_config import (
    HF_CONFIGS,
    hf_config_from_model_args,
    load_hf_config,
    model_args_from_hf_config,
)
from torchtitan.models.moe.args import MoEArgs

from .transformers_checkpoints import transformers_class, transformers_config

YARN_X40 = dict(original_seq_len=4096, rope_factor=40.0, beta_fast=32, beta_slow=1)
EXPECTED = {
    "deepseek_v2_lite": DeepSeekV3ModelArgs(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        norm_eps=1e-6,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax", route_norm=False),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_seq_len=163840,
        rope_theta=10000.0,
        **YARN_X40,
        mscale=0.707,
        mscale_all_dim=0.707,
        eos_id=100001,
        mtp_layers=0,
    ),
    "moonlight_16b_a3b": DeepSeekV3ModelArgs(
        vocab_size=163840,
        dim=2048,
        inter_dim=11264,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        norm_eps=1e-5,
        moe_args=MoEArgs(
            num_experts=64, num_shared_experts=2, top_k=6, score_func="sigmoid", route_norm=True, route_scale=2.446
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_seq_len=8192,
        rope_theta=50000.0,
        original_seq_len=8192,  # no YaRN
        eos_id=163586,
        mtp_layers=0,
    ),
    "deepseek_v3": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        norm_eps=1e-6,
        moe_args=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
            group_score="top2_sum",
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_seq_len=163840,
        rope_theta=10000.0,
        **YARN_X40,
        mscale=1.0,
        mscale_all_dim=1.0,
        eos_id=1,
        mtp_layers=1,
    ),
}
NAMES = list(EXPECTED)


def published(name: str) -> dict:
    return json.loads((HF_CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_each_published_config_parses_into_exactly_its_model_args(name):
    _, args = load_hf_config(str(HF_CONFIGS / f"{name}.json"), "--model.hf_config_path")
    assert args == EXPECTED[name]


def test_the_flavors_agree_with_the_published_configs():
    """671B is DeepSeek-V3 without its MTP layer; 16B is DeepSeek-V2-Lite's shape (the flavor keeps no EOS id)."""
    assert deepseekv3_flavors["671B"] == dataclasses.replace(EXPECTED["deepseek_v3"], mtp_layers=0)
    assert deepseekv3_flavors["16B"] == dataclasses.replace(EXPECTED["deepseek_v2_lite"], eos_id=0)


def test_deepseek_v3_config_builds_671_0b_parameters_without_mtp():
    args = dataclasses.replace(EXPECTED["deepseek_v3"], mtp_layers=0)
    assert round(args.nparams_total() / 1e9, 1) == 671.0


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_are_transformers_own_and_the_built_models(name):
    """nparams_total against transformers' model of the published config (which has no MTP module) and against our
    model as built (with the MTP module), both on the meta device."""
    config = {key: value for key, value in published(name).items() if key != "quantization_config"}
    pytest.importorskip("transformers")
    with torch.device("meta"):
        theirs = transformers_class(config)(transformers_config(config))
        ours = DeepSeekV3Model(EXPECTED[name])
    without_mtp = dataclasses.replace(EXPECTED[name], mtp_layers=0)
    assert without_mtp.nparams_total() == sum(p.numel() for p in theirs.parameters())
    assert EXPECTED[name].nparams_total() == sum(p.numel() for p in ours.parameters())


def test_the_fields_decide_the_routing_not_the_model_type():
    """scoring_func and topk_method say how DeepSeek's code routes; the model_type only supplies their defaults."""
    v3 = published("deepseek_v3")
    softmax = model_args_from_hf_config({**v3, "scoring_func": "softmax"}).moe_args
    assert (softmax.score_func, softmax.group_score, softmax.num_expert_groups) == ("softmax", "top2_sum", 8)
    v2_groups = model_args_from_hf_config({**v3, "topk_method": "group_limited_greedy"}).moe_args
    assert (v2_groups.score_func, v2_groups.group_score, v2_groups.num_limited_groups) == ("sigmoid", "max", 4)
    greedy = model_args_from_hf_config({**v3, "topk_method": "greedy"}).moe_args
    assert (greedy.num_expert_groups, greedy.num_limited_groups) == (None, None)  # greedy ignores n_group
    transformers_saved = {k: v for k, v in v3.items() if k not in ("scoring_func", "topk_method")}
    assert model_args_from_hf_config(transformers_saved).moe_args == EXPECTED["deepseek_v3"].moe_args
    v2 = {k: v for k, v in published("deepseek_v2_lite").items() if k not in ("scoring_func", "topk_method")}
    assert model_args_from_hf_config({**v2, "n_group": 8, "topk_group": 3}).moe_args.num_expert_groups is None


@pytest.mark.parametrize("name", NAMES)
def test_model_args_written_as_a_config_read_back_the_same(name):
    args = EXPECTED[name]
    assert model_args_from_hf_config(hf_config_from_model_args(args)) == args


V3_PATH = str(HF_CONFIGS / "deepseek_v3.json")
UNSUPPORTED = [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (this model computes silu)"),
    ({"attention_bias": True}, "attention_bias=True is not supported (this model computes no bias in attention"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported (this model computes no bias in FFN projections)"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported (this model computes separate"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported (this model computes an MoE in every layer after"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported (this model computes no dropout)"),
    ({"scoring_func": "tanh"}, "scoring_func='tanh' is not supported (this model computes sigmoid or softmax)"),
    ({"topk_method": "sinkhorn"}, "topk_method='sinkhorn' is not supported (this model computes noaux_tc or greedy"),
    ({"num_key_value_heads": 16}, "num_key_value_heads=16 is not supported (this model computes MLA, whose keys"),
    ({"rope_interleave": False}, "rope_interleave=False is not supported (this model computes RoPE on interleaved"),
    ({"model_type": "deepseek_v32"}, "model_type='deepseek_v32' is not supported (this model computes deepseek_v2"),
    (
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "rope_scaling type='dynamic' is not supported (this model computes default or yarn)",
    ),
    (
        {"rope_scaling": {**published("deepseek_v3")["rope_scaling"], "attention_factor": 1.2}},
        "rope_scaling attention_factor=1.2 is not supported (this model computes YaRN with attention_factor=None)",
    ),
    (
        {"rope_scaling": {**published("deepseek_v3")["rope_scaling"], "truncate": False}},
        "rope_scaling truncate=False is not supported (this model computes YaRN with truncate=True)",
    ),
    (
        {"max_position_embeddings": 4096},
        "max_position_embeddings=4096 with YaRN is not supported (this model computes YaRN past "
        "original_max_position_embeddings=4096)",
    ),
]


@pytest.mark.parametrize("change, message", UNSUPPORTED, ids=[next(iter(c)) for c, _ in UNSUPPORTED])
def test_a_value_the_model_does_not_compute_is_one_line_naming_field_and_value(change, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**published("deepseek_v3"), **change}))
    with pytest.raises(ValueError) as raised:
        load_hf_config(str(path), "--model.hf_config_path")
    (line,) = str(raised.value).splitlines()
    assert line.startswith(f"--model.hf_config_path {path}: {message}") and line.endswith("; fix the file")


def test_deepseek_v2_routing_scaled_after_renormalizing_is_one_line():
    """DeepSeek-V2's code leaves renormalized weights unscaled, V3's (and ours) scales them: a V2 config with both
    would be computed differently from its checkpoint's code."""
    config = {**published("deepseek_v2_lite"), "norm_topk_prob": True, "routed_scaling_factor": 16.0}
    with pytest.raises(ValueError, match=r"^routed_scaling_factor=16.0 with norm_topk_prob=true is not supported"):
        model_args_from_hf_config(config)
    assert model_args_from_hf_config({**config, "routed_scaling_factor": 1.0}).moe_args.route_norm


@pytest.mark.parametrize(
    "name, change, expected",
    [
        (
            "deepseek_v2_lite",
            {},
            [
                "aux_loss_alpha=0.001: training adds no sequence-wise auxiliary balance loss; it balances the experts "
                "aux-loss-free, by each router's selection bias (load_balance_coeff 0.001)"
            ],
        ),
        (
            "deepseek_v3",
            {"ep_size": 8, "initializer_range": 0.006},
            [
                "initializer_range=0.006 is not used: fresh weights start as DeepSeekV3Model.init_weights sets",
                "ep_size=8 is for inference: training's is --parallelism.expert_parallel_degree",
                "quantization_config (fp8) describes how the checkpoint stores its weights; training computes in "
                "--training.mixed_precision_param (and --quantize.float8_* where set)",
            ],
        ),
        ("deepseek_v3", {"index_topk": 2048}, ["config.json fields that no DeepSeek-V2/V3 config defines, ignored: "]),
    ],
    ids=["aux-loss", "recipe-and-inference", "unknown-field"],
)
def test_recipe_and_inference_fields_are_accepted_with_one_line_each(name, change, expected, caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan.models.deepseek_v3.hf_config"):
        args = model_args_from_hf_config({**published(name), **change})
    assert args == EXPECTED[name]
    lines = [record.getMessage() for record in caplog.records]
    if "index_topk" in change:
        assert lines[-1] == expected[0] + "['index_topk']"
        assert caplog.records[-1].levelno == logging.WARNING
    else:
        assert lines == expected


def test_the_mla_latent_norms_keep_eps_1e_6_whatever_rms_norm_eps():
    """DeepSeek's and transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps (Moonlight's is 1e-5)."""
    pytest.importorskip("transformers")
    config = published("moonlight_16b_a3b")
    with torch.device("meta"):
        theirs = transformers_class(config)(transformers_config({**config, "q_lora_rank": 1536}))
        ours = DeepSeekV3Model(dataclasses.replace(EXPECTED["moonlight_16b_a3b"], q_lora_rank=1536))
    their_attention, our_attention = theirs.model.layers[0].self_attn, ours.layers["0"].attention
    assert our_attention.kv_norm.eps == their_attention.kv_a_layernorm.variance_epsilon == 1e-6
    assert our_attention.q_norm.eps == their_attention.q_a_layernorm.variance_epsilon == 1e-6
    assert ours.layers["0"].attention_norm.eps == theirs.model.layers[0].input_layernorm.variance_epsilon == 1e-5
