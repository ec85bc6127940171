"""Convert between our state dict and the on-disk Hugging Face Qwen3-MoE format (one tensor per expert).

Our routed experts are stacked (E, out, in) tensors moe.experts.w1 / w2 / w3; the release stores
mlp.experts.{e}.gate_proj / down_proj / up_proj.weight, each (out, in), so converting is stacking / unstacking along
dim 0 (transformers 5 fuses them into gate_up_proj in memory and splits them again on save_pretrained). RoPE needs no
permutation: q_proj / k_proj are in the rotate-half layout our rope.py uses. Qwen3-MoE's router has no selection bias:
our moe.expert_bias (aux-loss-free balancing, off in Qwen's recipe) has no place in the format. The config.json side is
hf_config.py.
"""

import re
from collections.abc import Iterable

from torchtitan.components.hf_checkpoint import HFSource
from torchtitan.models.moe.hf_state_dict import (
    TRUNK_KEY_MAP,
    HFLayout,
    HFSources,
    HFStateDictAdapter,
)

from .args import Qwen3MoEModelArgs
from .hf_config import hf_config_from_model_args

__all__ = ["Qwen3MoEStateDictAdapter"]

# our key -> HF key, with "{}" standing for the layer index: the trunk's, then this model's own
_KEY_MAP = {
    **TRUNK_KEY_MAP,
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
# Our MoE state with no HF counterpart: the selection bias (zero unless aux-loss-free balancing trained it) and the
# token counts of that balancing; a load from HF starts both at zeros.
_OURS_ONLY = ("expert_bias", "tokens_per_expert")
# The linear layers' weights, the ones an FP8 release with block scales quantizes (attention, dense MLPs, experts);
# the embedding, the head, the norms and the router gate stay in higher precision.
_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)


class Qwen3MoEStateDictAdapter(HFStateDictAdapter):
    """Qwen3-MoE's layout (`_KEY_MAP`); FP8 exports quantize the linear layers' weights, as DeepSeek's releases
    choose them."""

    layout = HFLayout("Qwen3-MoE", _KEY_MAP, _OURS_ONLY, _FP8_WEIGHT)
    config_from_args = staticmethod(hf_config_from_model_args)
    biased_model_alternative = "train with the global-batch balance loss alone"
    model_args: Qwen3MoEModelArgs

    def selection_bias_ignored(self) -> str | None:
        return "Qwen3-MoE's Hugging Face format has no selection bias"

    def hf_sources(self, hf_keys: Iterable[str]) -> dict[str, HFSource]:
        """Where each of our tensors comes from among the HF tensor names `hf_keys` (FP8 scales left out: the reader
        dequantizes their weights). A layer past the model's, or a tensor with no place in it, is a ValueError
        (another model than these args); the selection bias and token counts start at zero."""
        n_layers, num_experts = self.model_args.n_layers, self.model_args.moe_args.num_experts
        sources = HFSources(self.layout)
        beyond = set()
        for key in hf_keys:
            if (layer := re.match(r"model\.layers\.(\d+)\.", key)) and int(layer.group(1)) >= n_layers:
                beyond.add(int(layer.group(1)))
            else:
                sources.add(key)
        if beyond:
            raise ValueError(
                f"transformer layers past the {n_layers} of the model shape given: model.layers.{min(beyond)}.* to "
                f"model.layers.{max(beyond)}.* (a deeper model)"
            )
        resolved = sources.resolve(num_experts)
        for i in range(n_layers):
            if i not in self.model_args.dense_layers:
                for name in _OURS_ONLY:
                    resolved[f"layers.{i}.moe.{name}"] = HFSource()
        return resolved
