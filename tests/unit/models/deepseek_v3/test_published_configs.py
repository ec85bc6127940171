"""Each shipped published config (hf_configs/) computes what transformers' own DeepseekV2ForCausalLM /
DeepseekV3ForCausalLM computes for it, on CPU in fp32.

Shrunk in width only: hidden size, FFN widths, heads, LoRA ranks, head dims and vocabulary are small; every other
value is the published one (expert counts, top-k, groups and their scoring, routing scale and renormalization, dense
layers, norms' eps, RoPE theta, YaRN factor and mscales, MTP). YaRN's original context is scaled down with
max_position_embeddings (the factor kept) so that the 40-token sequence runs past it. Depth is the published one,
except DeepSeek-V3's 61 layers of 256 experts (over a minute per forward pair on 2 cores): its 3 dense layers and 2
MoE layers; and Kimi K2's 61 layers of 384 experts: its dense layer and 2 MoE layers. Kimi K2 (model_type
kimi_k2) is compared with DeepseekV3ForCausalLM, the class its `architectures` names. transformers saves no MTP
module: ours is built (the config's one) and left out of the comparison.

The exact RoPE / YaRN numbers at the published sizes (beta_fast and beta_slow only matter past ~200 original
positions) are compared separately with transformers' rotary embedding and attention scale.
"""

import json
import sys

import pytest
import torch

from tests.unit.components._hf_safetensors import load_hf_safetensors
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.hf_config import HF_CONFIGS, model_args_from_hf_config
from torchtitan.models.deepseek_v3.rope import precompute_freqs_cis, rotary_scale, softmax_scale

from .conftest import from_hf
from .transformers_checkpoints import (
    fp32_experts,
    load_transformers_model,
    save_transformers_model,
    transformers_class,
    transformers_config,
)

pytest.importorskip("transformers")

NAMES = ["deepseek_v2_lite", "moonlight_16b_a3b", "deepseek_v3", "kimi_k2"]
WIDTH = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=256,
)
ORIGINAL_CONTEXT = 16
SEQ_LEN = 40
DEPTH = {"deepseek_v3": 5, "kimi_k2": 3}


def published(name: str) -> dict:
    return json.loads((HF_CONFIGS / f"{name}.json").read_text())


def shrunk_in_width(name: str) -> dict:
    """The published config with the WIDTH sizes (q LoRA 24 where it has one), YaRN's context scaled down to
    ORIGINAL_CONTEXT, DEPTH's layers where set, and without what only concerns stored weights and token ids
    (quantization_config: the reference's weights are fp32; BOS / EOS ids: past the small vocabulary)."""
    config = published(name)
    small = {**config, **WIDTH, "q_lora_rank": 24 if config["q_lora_rank"] else None}
    if rope := config.get("rope_scaling"):
        scale = config["max_position_embeddings"] // rope["original_max_position_embeddings"]
        small["rope_scaling"] = {**rope, "original_max_position_embeddings": ORIGINAL_CONTEXT}
        small["max_position_embeddings"] = ORIGINAL_CONTEXT * scale
    small["num_hidden_layers"] = DEPTH.get(name, config["num_hidden_layers"])
    for key in ("quantization_config", "bos_token_id", "eos_token_id"):
        small.pop(key, None)
    return small


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_for_the_published_config_shrunk_in_width(name, tmp_path):
    config = shrunk_in_width(name)
    # attention std 0.15: peaked enough for RoPE and the softmax scale to matter, while 27 layers of it still keep fp32
    # rounding from growing past the tolerance (at 0.3 it reaches ~1e-3)
    save_transformers_model(tmp_path, config, attention_std=0.15)
    args = fp32_experts(model_args_from_hf_config(config))
    assert args.max_seq_len > args.original_seq_len or "rope_scaling" not in config  # YaRN on where published
    assert args.mtp_layers == published(name).get("num_nextn_predict_layers", 0)

    model = DeepSeekV3Model(args)
    model.init_weights()
    state_dict = from_hf(args, load_hf_safetensors(str(tmp_path)))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and all(key.startswith("mtp.") for key in missing) and bool(missing) == bool(args.mtp_layers)

    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    assert SEQ_LEN > args.original_seq_len or args.max_seq_len == args.original_seq_len
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), load_transformers_model(tmp_path)(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


YARN_VARIANTS = {
    "published": {},
    "beta_fast_8": {"beta_fast": 8},
    "beta_slow_4": {"beta_slow": 4},
    "mscale_unequal": {"mscale": 1.0, "mscale_all_dim": 0.5},
    "no_mscale_all_dim": {"mscale_all_dim": None},
}


@pytest.mark.parametrize("variant", YARN_VARIANTS)
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3", "kimi_k2"])
def test_yarn_frequencies_and_scales_are_transformers_at_the_published_sizes(name, variant):
    config = published(name)
    config.pop("quantization_config", None)
    rope = {k: v for k, v in {**config["rope_scaling"], **YARN_VARIANTS[variant]}.items() if v is not None}
    config["rope_scaling"] = rope
    reference = transformers_config(config)
    modeling = sys.modules[transformers_class(config).__module__]
    prefix = transformers_class(config).__name__.removesuffix("ForCausalLM")
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(reference)
    with torch.device("meta"):
        attention_scale = getattr(modeling, f"{prefix}Attention")(reference, layer_idx=0).scaling

    args = model_args_from_hf_config(config)
    angles = precompute_freqs_cis(args)[1]  # position 1: (cos, sin) of each pair's frequency
    torch.testing.assert_close(torch.atan2(angles[:, 1], angles[:, 0]), rotary.inv_freq, rtol=1e-6, atol=0)
    assert rotary_scale(args) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert softmax_scale(args) == pytest.approx(attention_scale, rel=1e-12)
