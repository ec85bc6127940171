"""Convert between our state dict and the on-disk Hugging Face Qwen3-MoE format (one tensor per expert).

Our routed experts are stacked (E, out, in) tensors moe.experts.w1 / w2 / w3; the release stores
mlp.experts.{e}.gate_proj / down_proj / up_proj.weight, each (out, in), so converting is stacking / unstacking along
dim 0 (transformers 5 fuses them into gate_up_proj in memory and splits them again on save_pretrained). RoPE needs no
permutation: q_proj / k_proj are in the rotate-half layout our rope.py uses. Qwen3-MoE's router has no selection bias:
our moe.expert_bias (aux-loss-free balancing, off in Qwen's recipe) has no place in the format. The config.json side is
hf_config.py.
"""

import re
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.hf_checkpoint import HFSource

from .args import Qwen3MoEModelArgs
from .hf_config import hf_config_from_model_args

__all__ = ["Qwen3MoEStateDictAdapter"]

# our key -> HF key, with "{}" standing for the layer index
_KEY_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight",
}
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_EXPERT_KEY = "model.layers.{}.mlp.experts.{}.{}.weight"
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
# Our MoE state with no HF counterpart: the selection bias (zero unless aux-loss-free balancing trained it) and the
# token counts of that balancing; a load from HF starts both at zeros.
_OURS_ONLY = ("expert_bias", "tokens_per_expert")
# The linear layers' weights, the ones an FP8 release with block scales quantizes (attention, dense MLPs, experts);
# the embedding, the head, the norms and the router gate stay in higher precision.
_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)


class Qwen3MoEStateDictAdapter:
    optional_prefixes: tuple[str, ...] = ()  # every module of the model is in every checkpoint of it

    def __init__(self, model_args: Qwen3MoEModelArgs):
        self.model_args = model_args
        self.to_hf_map = {_pattern(ours): hf for ours, hf in _KEY_MAP.items()}
        self.from_hf_map = {_pattern(hf): ours for ours, hf in _KEY_MAP.items()}

    def hf_config(self) -> dict[str, Any]:
        """The transformers config.json of these model args."""
        return hf_config_from_model_args(self.model_args)

    def to_hf(self, state_dict: dict[str, torch.Tensor], drop_selection_bias: bool = False) -> dict[str, torch.Tensor]:
        """Our (full or DTensor, gathered here) state dict -> HF keys with per-expert tensors. ValueError for a
        selection bias that is not zero (aux-loss-free balancing trained it): transformers' Qwen3-MoE has none and
        would compute other logits; drop_selection_bias exports without it (some tokens then choose other experts)."""
        state_dict = {key: v.full_tensor() if isinstance(v, DTensor) else v for key, v in state_dict.items()}
        if not drop_selection_bias:
            if biased := next((key for key, v in state_dict.items() if key.endswith("expert_bias") and v.any()), None):
                raise ValueError(
                    f"{biased} is not zero (training balanced the experts with it), but Qwen3-MoE's Hugging Face "
                    "format has no selection bias: transformers would compute other logits than this model. Export it "
                    "without the bias, knowing that some tokens then choose other experts (scripts/convert_hf.py "
                    "to-hf --drop-selection-bias), or train with the global-batch balance loss alone"
                )
        return self.hf_layout(state_dict)

    def hf_layout(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full (or meta) state dict under HF keys, routed experts unstacked."""
        hf_state_dict = {}
        for key, value in state_dict.items():
            if expert := _OUR_EXPERTS.fullmatch(key):
                layer, name = expert.groups()
                for j in range(value.shape[0]):  # (E, out, in) -> E x (out, in)
                    hf_state_dict[_HF_EXPERT_KEY.format(layer, j, _EXPERT_NAMES[name])] = value[j]
            elif key.rsplit(".", 1)[-1] not in _OURS_ONLY:
                if (hf_key := _translate(key, self.to_hf_map)) is None:
                    raise ValueError(f"{key} has no Hugging Face counterpart in the Qwen3-MoE layout")
                hf_state_dict[hf_key] = value
        return hf_state_dict

    def hf_sources(self, hf_keys: Iterable[str]) -> dict[str, HFSource]:
        """Where each of our tensors comes from among the HF tensor names `hf_keys` (FP8 scales left out: the reader
        dequantizes their weights). A layer past the model's, or a tensor with no place in it, is a ValueError
        (another model than these args); the selection bias and token counts start at zero."""
        n_layers, num_experts = self.model_args.n_layers, self.model_args.moe_args.num_experts
        sources: dict[str, HFSource] = {}
        experts: dict[tuple[str, str], dict[int, str]] = {}  # (layer, w1|w2|w3) -> {expert: HF key}
        hf_to_ours = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
        beyond, unknown = set(), []
        for key in hf_keys:
            if (layer := re.match(r"model\.layers\.(\d+)\.", key)) and int(layer.group(1)) >= n_layers:
                beyond.add(int(layer.group(1)))
            elif (expert := _HF_EXPERT.fullmatch(key)) and expert.group(3) in hf_to_ours:
                layer_id, j, name = expert.groups()
                experts.setdefault((layer_id, hf_to_ours[name]), {})[int(j)] = key
            elif (ours := _translate(key, self.from_hf_map)) is not None:
                sources[ours] = HFSource((key,))
            else:
                unknown.append(key)
        if beyond:
            raise ValueError(
                f"transformer layers past the {n_layers} of the model shape given: model.layers.{min(beyond)}.* to "
                f"model.layers.{max(beyond)}.* (a deeper model)"
            )
        if unknown:
            raise ValueError(
                f"{len(unknown)} of its tensors have no place in a Qwen3-MoE model, e.g. {sorted(unknown)[:3]}"
            )
        for (layer_id, name), per_expert in experts.items():
            if (found := sorted(per_expert)) != list(range(num_experts)):
                raise ValueError(f"layer {layer_id} {name}: expected experts 0..{num_experts - 1}, found {found}")
            keys = tuple(per_expert[j] for j in range(num_experts))  # stacked: (E, out, in)
            sources[f"layers.{layer_id}.moe.experts.{name}"] = HFSource(keys, stacked=True)
        for i in range(n_layers):
            if i not in self.model_args.dense_layers:
                for name in _OURS_ONLY:
                    sources[f"layers.{i}.moe.{name}"] = HFSource()
        return sources

    def is_fp8_weight(self, hf_key: str) -> bool:
        """Whether an FP8 export with block scales (`scripts/convert_hf.py to-hf --fp8-blocks`) stores this weight in
        float8_e4m3fn: the linear layers' weights, as DeepSeek's releases choose them."""
        return _FP8_WEIGHT.fullmatch(hf_key) is not None

    def args_for_checkpoint(
        self, keys: Collection[str], path: str, *, in_hf: bool, requested: bool, flag: str
    ) -> Qwen3MoEModelArgs:
        """The args to build for starting from the checkpoint at `path`: these (Qwen3-MoE has no optional modules)."""
        return self.model_args


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)"))


def _translate(key: str, mapping: dict[re.Pattern, str]) -> str | None:
    """`key` renamed by the first pattern of `mapping` it matches; None when none does."""
    for pattern, target in mapping.items():
        if match := pattern.fullmatch(key):
            return target.format(*match.groups())
    return None
