"""Checkpoints as a user gets them from Hugging Face: folders written by transformers' own
`DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM.save_pretrained`, for the tests that start training or sampling
from them and that compare our logits with transformers'."""

import dataclasses
from pathlib import Path

import torch

from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

# transformers' DeepseekV3Config defaults (sigmoid routing limited to 4 of 8 expert groups, top-8, q_lora, 1 MTP layer
# in num_nextn_predict_layers, no tensor of it saved) shrunk: 3 layers (1 dense), small dims, 16 experts. The
# vocabulary is the shipped tokenizer's, whose BOS / EOS ids (0 / 1) are the config's too.
DEFAULT = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
CONFIGS = {
    "default": DEFAULT,
    # YaRN (DeepSeek-V3's rope scaling, its softmax scale included) over 4x the original context, and other groups
    "yarn": {
        **DEFAULT,
        "max_position_embeddings": 128,
        "rope_parameters": dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32,
            beta_slow=1,
            mscale=0.7,
            mscale_all_dim=0.7,
        ),
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
    },
}


def save_transformers_checkpoint(folder: Path, case: str, seed: int = 0) -> Path:
    """`folder` written by transformers' save_pretrained for CONFIGS[case] (see `save_transformers_model`)."""
    return save_transformers_model(folder, CONFIGS[case], seed)


def save_transformers_model(folder: Path, config: dict, seed: int = 0, attention_std: float = 0.3) -> Path:
    """`folder` written by transformers' save_pretrained of its DeepseekV2 or V3 model (by config's model_type) for
    the config.json dict `config`, with weights that look learned: random norms and selection bias, large attention
    projections (std `attention_std`: peaked attention, sensitive to RoPE and the softmax scale) and a large output
    head (peaked predictions, so greedy decoding has clear winners)."""
    torch.manual_seed(seed)
    model = transformers_class(config)(transformers_config(config))
    attention_projections = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif any(f"self_attn.{w}." in name for w in attention_projections) or name == "lm_head.weight":
                param.normal_(std=attention_std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(str(folder))
    return folder


def transformers_config(config: dict):
    """transformers' config object (DeepseekV2Config or DeepseekV3Config) of a config.json dict."""
    import transformers

    fields = {key: value for key, value in config.items() if key != "model_type"}
    return transformers.AutoConfig.for_model(config.get("model_type", "deepseek_v3"), **fields)


def transformers_class(config: dict):
    """transformers' own model class for a DeepSeek config.json dict: DeepseekV2ForCausalLM or DeepseekV3ForCausalLM."""
    import transformers

    return {"deepseek_v2": transformers.DeepseekV2ForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[
        config.get("model_type", "deepseek_v3")
    ]


def fp32_experts(args: DeepSeekV3ModelArgs) -> DeepSeekV3ModelArgs:
    """args with the routed experts' per-expert loop in the input's dtype instead of the bf16 grouped GEMMs, so our
    logits compare with transformers' in fp32."""
    return dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))


def load_transformers_model(folder: Path):
    """The reference: transformers' model of the folder, fp32, eager attention."""
    import json

    config = json.loads((folder / "config.json").read_text())
    model_class = transformers_class(config)
    return model_class.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
