"""Checkpoints as a user gets them from Hugging Face: folders written by transformers' own
`DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM.save_pretrained`, for the tests that start training or sampling
from them and that compare our logits with transformers'."""

import dataclasses
import json
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
    return transformers.AutoConfig.for_model(computed_as(config), **fields)


def transformers_class(config: dict):
    """transformers' own model class for a DeepSeek config.json dict: DeepseekV2ForCausalLM or DeepseekV3ForCausalLM."""
    import transformers

    return {"deepseek_v2": transformers.DeepseekV2ForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[
        computed_as(config)
    ]


def computed_as(config: dict) -> str:
    """The transformers model_type computing a config.json dict: Kimi K2's (kimi_k2) is DeepSeek-V3's architecture."""
    model_type = config.get("model_type", "deepseek_v3")
    return "deepseek_v3" if model_type == "kimi_k2" else model_type


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


def save_fp8_release(transformers_folder: Path, folder: Path, block: tuple[int, int]) -> Path:
    """`folder`: the transformers checkpoint in the layout of DeepSeek's FP8 releases, quantized here independently of
    the code under test: every linear layer's `*_proj[_with_mqa].weight` of attention and MLPs (eh_proj aside) in
    float8_e4m3fn with a float32 `*_proj.weight_scale_inv` per block of `block` rows x columns (amax / 448, partial
    blocks at the edges), config.json's quantization_config naming the block. Small shards, so that a weight and its
    scales may lie in different shards. Next to it, `<folder>_dequantized`: the same folder with each FP8 weight
    replaced by its dequantized float32 values, which transformers loads as the reference."""
    from safetensors.torch import load_file

    from torchtitan.components.hf_safetensors import save_hf_safetensors

    rows, cols = block
    fp8, dequantized = {}, {}
    for key, weight in load_file(str(transformers_folder / "model.safetensors")).items():
        if not (key.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".eh_proj." not in key):
            fp8[key] = dequantized[key] = weight
            continue
        grid = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        scale_inv = torch.empty(grid)
        values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        back = torch.empty(weight.shape)
        for i in range(grid[0]):
            for j in range(grid[1]):
                region = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
                scale_inv[i, j] = weight[region].abs().max().float() / 448
                values[region] = (weight[region].float() / scale_inv[i, j]).to(torch.float8_e4m3fn)
                back[region] = values[region].float() * scale_inv[i, j]
        fp8[key], fp8[key + "_scale_inv"], dequantized[key] = values, scale_inv, back
    config = json.loads((transformers_folder / "config.json").read_text())
    reference = folder.with_name(folder.name + "_dequantized")
    save_hf_safetensors(dequantized, str(reference))
    (reference / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    save_hf_safetensors(fp8, str(folder), max_shard_size="20KB")
    (folder / "config.json").write_text(json.dumps(config))
    return folder
