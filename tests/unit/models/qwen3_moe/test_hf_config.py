"""Qwen3-MoE's config.json reader: the published configs give the flavors, every field that changes the math is read
or refused in one line, and our export reads back to the same args."""

import dataclasses
import json
import logging

import pytest
import torch

from torchtitan.models.qwen3_moe import Qwen3MoEModel, qwen3_moe_flavors
from torchtitan.models.qwen3_moe.hf_config import (
    HF_CONFIGS,
    hf_config_from_model_args,
    load_hf_config,
    model_args_from_hf_config,
)

from .transformers_checkpoints import PUBLISHED, shrunk_config


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_the_published_configs_give_the_flavors(flavor):
    _, args = load_hf_config(str(HF_CONFIGS / PUBLISHED[flavor]), "--model.hf_config_path")
    assert args == qwen3_moe_flavors[flavor]


def test_the_published_30b_a3b_counts_its_published_sizes():
    """30.5B parameters, 3.3B of them active (Qwen3's model card), counted from the shapes the model builds."""
    args = qwen3_moe_flavors["30B-A3B"]
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    active = total - experts * (128 - 8) // 128
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 < active < 3.4e9  # 3.35B


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"model_type": "qwen2_moe"}, r"model_type='qwen2_moe' is not supported \(this model computes qwen3_moe"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported \(this model computes silu\)"),
        ({"attention_bias": True}, r"attention_bias=True is not supported \(this model computes no bias"),
        ({"tie_word_embeddings": True}, r"tie_word_embeddings=True is not supported \(this model computes separate"),
        ({"use_sliding_window": True}, r"use_sliding_window=True is not supported \(this model computes full causal"),
        ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported \(this model computes no dropout\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type='yarn' is not supported"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 must divide num_attention_heads=32"),
        ({"num_experts_per_tok": 129}, r"num_experts_per_tok=129 must be at most num_experts=128"),
        ({"mlp_only_layers": [2]}, r"mlp_only_layers=\[2\] must list layers 0\.\.1"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 must be a positive whole number"),
        ({"head_dim": 15}, r"head_dim=15 must be even"),
        ({"num_local_experts": 64}, r"num_experts=128 and num_local_experts=64 differ"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_a_value_this_model_does_not_compute_is_one_line_naming_it(tmp_path, change, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shrunk_config("30B-A3B", **change)))
    with pytest.raises(ValueError, match=expected) as err:
        load_hf_config(str(path), "--model.hf_config_path")
    assert "\n" not in str(err.value) and str(err.value).startswith(f"--model.hf_config_path {path}: ")


def test_what_transformers_5_writes_reads_the_same():
    """save_pretrained writes num_experts as num_local_experts and RoPE's base in rope_parameters."""
    published = shrunk_config("30B-A3B")
    written = {k: v for k, v in published.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    written |= {"num_local_experts": 128, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    assert model_args_from_hf_config(written) == model_args_from_hf_config(published)


def test_dense_layers_are_transformers_choice():
    config = shrunk_config("30B-A3B", num_hidden_layers=6, mlp_only_layers=[1], decoder_sparse_step=3)
    assert model_args_from_hf_config(config).dense_layers == (0, 1, 3, 4)  # sparse where (i + 1) % 3 == 0, not 1


def test_our_export_reads_back_to_the_same_args():
    for flavor in ("debugmodel_tiny", "235B-A22B"):
        args = qwen3_moe_flavors[flavor]
        assert model_args_from_hf_config(hf_config_from_model_args(args)) == args
    dense = dataclasses.replace(qwen3_moe_flavors["debugmodel_tiny"], dense_layers=(0, 2))
    assert model_args_from_hf_config(hf_config_from_model_args(dense)) == dense


def test_recipe_fields_are_read_and_unknown_fields_named(caplog):
    config = shrunk_config("30B-A3B", router_aux_loss_coef=0.01, some_new_field=1)
    with caplog.at_level(logging.INFO):
        args = model_args_from_hf_config(config)
    assert args.moe_args.global_aux_loss_coeff == 0.01 and args.moe_args.load_balance_coeff is None
    assert "router_aux_loss_coef=0.01: every MoE layer adds the global-batch balance loss" in caplog.text
    assert "config.json fields that no Qwen3-MoE config defines, ignored: ['some_new_field']" in caplog.text
