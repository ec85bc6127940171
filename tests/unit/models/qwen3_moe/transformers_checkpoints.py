"""Qwen3-MoE checkpoints as a user gets them from Hugging Face: folders written by transformers' own
`Qwen3MoeForCausalLM.save_pretrained`, from the published configs shrunk in width (every field that is no width kept:
heads and their grouping, 128 experts and top-8, norm_topk_prob, RoPE's base, the norms' eps, the context)."""

import dataclasses
import json
from pathlib import Path

import torch

from torchtitan.models.qwen3_moe import Qwen3MoEModelArgs
from torchtitan.models.qwen3_moe.hf_config import HF_CONFIGS

SHRUNK = dict(
    vocab_size=2048,  # the shipped tokenizer's, whose BOS / EOS ids are 0 / 1
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    head_dim=16,
    num_hidden_layers=2,
    bos_token_id=0,
    eos_token_id=1,
)
PUBLISHED = {"30B-A3B": "qwen3_30b_a3b.json", "235B-A22B": "qwen3_235b_a22b.json"}


def shrunk_config(name: str, **changes) -> dict:
    """The published config.json of `name` (a PUBLISHED key) shrunk in width, with `changes`."""
    return {**json.loads((HF_CONFIGS / PUBLISHED[name]).read_text()), **SHRUNK, **changes}


def save_transformers_model(folder: Path, config: dict, seed: int = 0) -> Path:
    """`folder` written by transformers' save_pretrained of Qwen3MoeForCausalLM for the config.json dict `config`,
    with weights that look learned: random norms, large attention projections and output head (peaked attention and
    predictions) and a large router gate (clear top-k choices)."""
    import transformers

    torch.manual_seed(seed)
    fields = {key: value for key, value in config.items() if key != "model_type"}
    model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.for_model("qwen3_moe", **fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "self_attn" in name or name == "lm_head.weight":
                param.normal_(std=0.3)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(std=0.5)
    model.save_pretrained(str(folder))
    return folder


def load_transformers_model(folder: Path):
    """The reference: transformers' model of the folder, fp32, eager attention."""
    import transformers

    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def fp32_experts(args: Qwen3MoEModelArgs) -> Qwen3MoEModelArgs:
    """args with the routed experts' per-expert loop in the input's dtype instead of the bf16 grouped GEMMs, so our
    logits compare with transformers' in fp32."""
    return dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))
