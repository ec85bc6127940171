"""What every model's state-dict adapter (a model's `state_dict_adapter.py`) shares with the others: renaming keys
through a map of templates, and the routed experts, stacked (E, out, in) tensors moe.experts.w1 / w2 / w3 here and
one (out, in) tensor per expert in Hugging Face's layout (mlp.experts.{j}.gate_proj / down_proj / up_proj), so that
converting them is stacking / unstacking along dim 0.
"""

import re
from collections.abc import Callable, Collection
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.hf_checkpoint import HFSource

__all__ = ["HF_FUSED_EXPERTS", "HFSources", "HFStateDictAdapter", "HFLayout", "TRUNK_KEY_MAP", "unstack_experts"]

TRUNK_KEY_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight",
}
"""Our key -> HF key of the trunk's and the block's tensors (`decoder.py`, `block.py`) but the attention's, "{}"
standing for the layer index: the same in every model's layout, to which a model adds its attention's."""
HF_FUSED_EXPERTS = "model.layers.{}.mlp.experts"
"""The routed experts' module of layer "{}": on disk its per-expert tensors (`_HF_EXPERT_KEY`), in transformers >= 5
in memory two fused parameters, gate_up_proj (E, 2 x hidden, dim; gate's rows first) and down_proj (E, dim, hidden),
which peft's LoRA adapts (models/moe/lora_export.py)."""
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_EXPERT_KEY = HF_FUSED_EXPERTS + ".{}.{}.weight"
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")


class HFLayout:
    """A model family's Hugging Face layout: our keys <-> HF keys by a map of templates (our key -> HF key), "{}"
    standing for a layer index; `ours_only`, the last parts of keys of training state with no HF counterpart;
    `fp8_weight`, the HF weights an FP8 release with block scales stores in float8_e4m3fn."""

    def __init__(self, family: str, ours_to_hf: dict[str, str], ours_only: tuple[str, ...], fp8_weight: re.Pattern):
        self.family, self.ours_only, self.fp8_weight = family, ours_only, fp8_weight
        self._to_hf = {_pattern(ours): hf for ours, hf in ours_to_hf.items()}
        self._from_hf = {_pattern(hf): ours for ours, hf in ours_to_hf.items()}

    def to_hf(self, key: str) -> str | None:
        """The HF key of our `key`; None when no template matches it."""
        return _translate(key, self._to_hf)

    def from_hf(self, key: str) -> str | None:
        """Our key of the HF `key`; None when no template matches it."""
        return _translate(key, self._from_hf)

    def state_dict_to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full (or meta) state dict under HF keys, routed experts unstacked and `ours_only` state left out;
        ValueError for a tensor with no HF counterpart."""
        hf_state_dict = {}
        for key, value in state_dict.items():
            if (experts := unstack_experts(key, value)) is not None:
                hf_state_dict.update(experts)
            elif key.rsplit(".", 1)[-1] not in self.ours_only:
                if (hf_key := self.to_hf(key)) is None:
                    raise ValueError(f"{key} has no Hugging Face counterpart in the {self.family} layout")
                hf_state_dict[hf_key] = value
        return hf_state_dict


class HFStateDictAdapter:
    """The part of a model's `StateDictAdapter` (components/checkpoint.py) that is the same in every model: its args,
    our state dict in its Hugging Face `layout`, the weights an FP8 export quantizes, the selection bias check of
    exports and a checkpoint that holds every module. A model's subclass sets `layout`, `config_from_args` and
    `biased_model_alternative` and gives `hf_sources`; one with more (DeepSeek-V3's MTP) overrides the rest."""

    optional_prefixes: tuple[str, ...] = ()  # every module of the model is in every checkpoint of it
    layout: ClassVar[HFLayout]
    config_from_args: ClassVar[Callable[[Any], dict[str, Any]]]
    """Model args -> their transformers config.json (a model's `hf_config.hf_config_from_model_args`)."""
    biased_model_alternative: ClassVar[str]
    """What else one can do with a model whose trained selection bias its transformers class ignores."""

    def __init__(self, model_args: Any):
        self.model_args = model_args

    def hf_config(self) -> dict[str, Any]:
        """The transformers config.json of these model args."""
        return self.config_from_args(self.model_args)

    def selection_bias_ignored(self) -> str | None:
        """Why transformers' class of these args computes without the routers' selection bias (None: it uses it)."""
        return None

    def to_hf(self, state_dict: dict[str, torch.Tensor], drop_selection_bias: bool = False) -> dict[str, torch.Tensor]:
        """Our (full or DTensor, gathered here) state dict -> HF keys with per-expert tensors (`hf_layout`), for a
        folder transformers computes this model from: ValueError for a selection bias that is not zero (aux-loss-free
        balancing trained it) where transformers ignores it (`selection_bias_ignored`). drop_selection_bias: export
        without the bias (every reader then computes the model without it, which chooses other experts for some
        tokens)."""
        # gathered first, in the same order on every rank (a collective each), so copies of tensors are full too
        state_dict = _full_tensors(state_dict)
        if drop_selection_bias:
            state_dict = {key: value for key, value in state_dict.items() if not key.endswith("expert_bias")}
        elif (ignored := self.selection_bias_ignored()) and (biased := _nonzero_selection_bias(state_dict)):
            raise ValueError(
                f"{biased} is not zero (training balanced the experts with it), but {ignored}: transformers would "
                "compute other logits than this model. Export it without the bias, knowing that some tokens then "
                "choose other experts (scripts/convert_hf.py to-hf --drop-selection-bias), or "
                f"{self.biased_model_alternative}"
            )
        return self.hf_layout(state_dict)

    def hf_layout(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full (or meta) state dict under HF keys, routed experts unstacked."""
        return self.layout.state_dict_to_hf(state_dict)

    def is_fp8_weight(self, hf_key: str) -> bool:
        """Whether an FP8 export with block scales (`scripts/convert_hf.py to-hf --fp8-blocks`) stores this weight in
        float8_e4m3fn."""
        return self.layout.fp8_weight.fullmatch(hf_key) is not None

    def args_for_checkpoint(self, keys: Collection[str], path: str, *, in_hf: bool, requested: bool, flag: str) -> Any:
        """The args to build for starting from the checkpoint at `path`: these (the model has no optional modules)."""
        return self.model_args


def _full_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with each DTensor gathered whole: a collective each, in the same order on every rank."""
    return {key: v.full_tensor() if isinstance(v, DTensor) else v for key, v in state_dict.items()}


def _nonzero_selection_bias(state_dict: dict[str, torch.Tensor]) -> str | None:
    """The first router selection bias (moe.expert_bias) that is not zero: aux-loss-free balancing trained it, and a
    reader that ignores it computes other logits. None when every one is zero."""
    return next((key for key, v in state_dict.items() if key.endswith("expert_bias") and v.any()), None)


def unstack_experts(key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Our stacked routed experts (E, out, in) at `key` as E HF tensors (out, in); None for a key of another tensor."""
    if (expert := _OUR_EXPERTS.fullmatch(key)) is None:
        return None
    layer, name = expert.groups()
    return {_HF_EXPERT_KEY.format(layer, j, _EXPERT_NAMES[name]): value[j] for j in range(value.shape[0])}


class HFSources:
    """Where each of our tensors comes from among a checkpoint's HF tensor names (`add` each, then `resolve`): a
    routed expert's weight is one of the stacked tensor of its layer's w1 / w2 / w3, another tensor is the one `layout`
    renames it to, and the rest have no place in the model."""

    def __init__(self, layout: HFLayout):
        self.layout = layout
        self._sources: dict[str, HFSource] = {}
        self._hf_to_ours = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
        self._experts: dict[tuple[str, str], dict[int, str]] = {}  # (layer, w1|w2|w3) -> {expert: HF key}
        self._unknown: list[str] = []

    def add(self, hf_key: str) -> None:
        if (expert := _HF_EXPERT.fullmatch(hf_key)) and expert.group(3) in self._hf_to_ours:
            layer_id, j, name = expert.groups()
            self._experts.setdefault((layer_id, self._hf_to_ours[name]), {})[int(j)] = hf_key
        elif (ours := self.layout.from_hf(hf_key)) is not None:
            self._sources[ours] = HFSource((hf_key,))
        else:
            self._unknown.append(hf_key)

    def resolve(self, num_experts: int) -> dict[str, HFSource]:
        """Our tensor -> its source; ValueError for HF tensors with no place in the model, or a layer that lacks an
        expert of 0..num_experts - 1 or holds more."""
        if unknown := self._unknown:
            raise ValueError(
                f"{len(unknown)} of its tensors have no place in a {self.layout.family} model, e.g. "
                f"{sorted(unknown)[:3]}"
            )
        sources = dict(self._sources)
        for (layer_id, name), per_expert in self._experts.items():
            if (found := sorted(per_expert)) != list(range(num_experts)):
                raise ValueError(f"layer {layer_id} {name}: expected experts 0..{num_experts - 1}, found {found}")
            keys = tuple(per_expert[j] for j in range(num_experts))  # stacked: (E, out, in)
            sources[f"layers.{layer_id}.moe.experts.{name}"] = HFSource(keys, stacked=True)
        return sources


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)"))


def _translate(key: str, mapping: dict[re.Pattern, str]) -> str | None:
    """`key` renamed by the first pattern of `mapping` it matches; None when none does."""
    for pattern, target in mapping.items():
        if match := pattern.fullmatch(key):
            return target.format(*match.groups())
    return None
