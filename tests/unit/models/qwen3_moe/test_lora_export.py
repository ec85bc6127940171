"""Qwen3-MoE's LoRA exports (scripts/convert_hf.py to-peft, to-hf --lora-base) through its state-dict adapter's key
map alone: peft on transformers' Qwen3MoeForCausalLM, and the merged folder, compute our model's logits."""

import json

import pytest
import torch

from tests.unit.models.deepseek_v3.test_convert_hf import convert_hf
from tests.unit.models.moe._lora_runs import ALPHA, assert_peft_holds, lora_run

from .test_hf import LOGITS_ATOL
from .transformers_checkpoints import load_transformers_model, save_transformers_model, shrunk_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# dense MLPs in layers 0 and 2 (mlp_only_layers, decoder_sparse_step), 16 routed experts (top-8) in layer 1
CONFIG = shrunk_config("30B-A3B", num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=2, num_experts=16)


def test_to_peft_and_the_merged_export_compute_our_logits(tmp_path):
    hf = save_transformers_model(tmp_path / "hf", CONFIG)
    ours, checkpoint = lora_run(hf, tmp_path / "run", "qwen3_moe", ["attention", "mlp", "experts"])
    lora = ["--lora-alpha", str(ALPHA)]
    convert_hf.main(
        [
            "to-peft",
            str(checkpoint),
            str(tmp_path / "peft"),
            "--model",
            "qwen3_moe",
            "--hf-config",
            str(hf / "config.json"),
            *lora,
        ]
    )
    convert_hf.main(
        [
            "to-hf",
            str(checkpoint),
            str(tmp_path / "merged"),
            "--model",
            "qwen3_moe",
            "--lora-base",
            str(hf),
            *lora,
            "--dtype",
            "float32",
        ]
    )

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert config["target_modules"] == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(3) for n in attention)
    mlps = [f"model.layers.{i}.mlp.{n}.weight" for i in (0, 2) for n in ("gate_proj", "up_proj", "down_proj")]
    experts = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    assert config["target_parameters"] == sorted(mlps + experts)

    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = peft.PeftModel.from_pretrained(load_transformers_model(hf), str(tmp_path / "peft")).eval()
    assert_peft_holds(reference, tmp_path / "peft")
    with torch.no_grad():
        logits, adapted = ours(tokens), reference(tokens).logits
        base = load_transformers_model(hf)(tokens).logits
        merged = load_transformers_model(tmp_path / "merged")(tokens).logits
    assert (logits - base).abs().max() > 0.1  # the adapters change the model
    torch.testing.assert_close(logits, adapted, rtol=1e-5, atol=LOGITS_ATOL)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=LOGITS_ATOL)
