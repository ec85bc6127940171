"""LoRA adapters (`models/moe/lora.py`) out of our checkpoints: in `peft`'s layout, or merged into their base.

Our adapters are named after the module they adapt; its HF name is the one the model's state-dict adapter gives
its weight (`HFLayout.to_hf`), so a model needs nothing beyond its base key map. In peft's layout, for
transformers >= 5 (whose MoE experts are fused 3-D parameters):
- an nn.Linear's `<ours>.lora_a` (r, in) / `.lora_b` (out, r) are `base_model.model.<hf module>.lora_A.weight` /
  `.lora_B.weight`, unchanged;
- the routed experts of layer i (`HF_FUSED_EXPERTS`, `mlp.experts` with parameters gate_up_proj (E, 2 x hidden, dim)
  and down_proj (E, dim, hidden)) get two nested `ParamWrapper`s, gate_up_proj's inside (keys
  `<experts>.base_layer.lora_A.weight`, ...) and down_proj's outside (`<experts>.lora_A.weight`, ...): lora_A is
  (E x r, in) with row e r + j = A[e, j], lora_B is (out, r x E) with column j E + e = B[e, :, j], and peft adds
  scaling x B[e] A[e] to expert e's weight, as ours do.
`adapter_config.json` names the attention's linears in `target_modules` and everything of the MLPs in
`target_parameters` (each linear's `<module>.weight`, the experts' two fused parameters): peft 0.21 (with
transformers >= 5) rewrites every `target_modules` entry ending in gate_proj / up_proj / down_proj into the routed
experts' fused parameters, which would drop the dense layers' and shared experts' adapters and double the experts'
rank (huggingface/peft#3711); a parameter target of an nn.Linear's weight computes the same W + s B A and keeps
`lora_A` / `lora_B` under the module's name.

The merge is W + (alpha / r) B A per adapted weight, in float32 (per expert for the routed experts: w1 takes the
first `hidden` rows of B_gate_up, w3 the rest).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torchtitan.models.moe.experts import ADAPTER_NAMES
from torchtitan.models.moe.hf_state_dict import HF_FUSED_EXPERTS, HFLayout
from torchtitan.models.moe.lora import LORA_TARGETS, is_adapter

__all__ = [
    "PEFT_CONFIG_NAME",
    "PEFT_WEIGHTS_NAME",
    "lora_rank",
    "lora_targets",
    "merge_adapters",
    "peft_config",
    "to_peft",
]

PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_CONFIG_NAME = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(lora_(?:gate_up|down)_[ab])")
_LINEAR = re.compile(r"(.+)\.lora_([ab])")
_GATE_UP_A, _GATE_UP_B, _DOWN_A, _DOWN_B = ADAPTER_NAMES


def lora_targets(names: Iterable[str]) -> list[str]:
    """The `lora.targets` (of `LORA_TARGETS`) whose adapters the state-dict `names` (adapters only) hold."""
    found = set()
    for name in names:
        if _EXPERTS.fullmatch(name):
            found.add("experts")
        elif ".attention." in name:
            found.add("attention")
        elif ".feed_forward." in name or ".shared_experts." in name:
            found.add("mlp")
    return [target for target in LORA_TARGETS if target in found]


def lora_rank(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """r of the adapters' shapes (name -> shape; A is (r, in), the experts' (E, r, in)); ValueError when they hold
    several."""
    ranks = {}
    for name, shape in shapes.items():
        if name.endswith("_a"):
            ranks.setdefault(shape[-2], name)
    if len(ranks) != 1:
        raise ValueError(f"the adapters have ranks {sorted(ranks)} (e.g. {sorted(ranks.values())[:2]}), not one")
    return next(iter(ranks))


def to_peft(adapters: Mapping[str, torch.Tensor], layout: HFLayout) -> dict[str, torch.Tensor]:
    """Our adapters (state-dict names -> tensors) under peft's keys and shapes (the module docstring)."""
    peft = {}
    for name, value in adapters.items():
        if experts := _EXPERTS.fullmatch(name):
            layer, which = experts.groups()
            module = HF_FUSED_EXPERTS.format(layer) + (".base_layer" if "gate_up" in which else "")
            num_experts, rows, cols = value.shape
            if which.endswith("_a"):  # (E, r, in) -> (E r, in)
                key, value = "lora_A", value.reshape(num_experts * rows, cols)
            else:  # (E, out, r) -> (out, r E): column j E + e
                key, value = "lora_B", value.permute(1, 2, 0).reshape(rows, cols * num_experts)
            peft[f"{_PEFT_PREFIX}{module}.{key}.weight"] = value.contiguous()
        else:
            module, side = _linear(name, layout)
            peft[f"{_PEFT_PREFIX}{module}.lora_{side.upper()}.weight"] = value.contiguous()
    return peft


def peft_config(names: Iterable[str], layout: HFLayout, rank: int, alpha: float) -> dict[str, Any]:
    """The `adapter_config.json` of the adapters named `names`: LoRA of rank `rank` and alpha `alpha` on exactly the
    modules (attention) and parameters (MLPs, routed experts) they adapt, for transformers' causal LM."""
    modules, parameters = set(), set()
    for name in names:
        if experts := _EXPERTS.fullmatch(name):
            module = HF_FUSED_EXPERTS.format(experts.group(1))
            parameters.update((f"{module}.gate_up_proj", f"{module}.down_proj"))
            continue
        module, _ = _linear(name, layout)
        if re.search(r"\.(gate|up|down)_proj$", module):  # not a target module: peft would rewrite it (docstring)
            parameters.add(f"{module}.weight")
        else:
            modules.add(module)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": sorted(modules) or None,
        "target_parameters": sorted(parameters) or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
    }


@torch.no_grad()
def merge_adapters(
    state_dict: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """Our full (base) state dict with every adapted weight W replaced by W + (alpha / r) B A, in float32; the rest
    as it is. `adapters`: every adapter of its targets (A and B of each); ValueError for one whose weight the state
    dict lacks."""
    scale = alpha / lora_rank({name: tuple(value.shape) for name, value in adapters.items()})
    merged = dict(state_dict)

    def weight(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise ValueError(f"the base has no {key} for the adapters of it")
        return state_dict[key].float()

    for name, a in adapters.items():
        if experts := _EXPERTS.fullmatch(name):
            layer, which = experts.groups()
            prefix = f"layers.{layer}.moe.experts."
            if which == _GATE_UP_A:
                delta = torch.bmm(adapters[prefix + _GATE_UP_B].float(), a.float()) * scale  # (E, 2 hidden, dim)
                w1 = weight(prefix + "w1")
                merged[prefix + "w1"] = w1 + delta[:, : w1.shape[1]]
                merged[prefix + "w3"] = weight(prefix + "w3") + delta[:, w1.shape[1] :]
            elif which == _DOWN_A:
                delta = torch.bmm(adapters[prefix + _DOWN_B].float(), a.float()) * scale  # (E, dim, hidden)
                merged[prefix + "w2"] = weight(prefix + "w2") + delta
        elif (linear := _LINEAR.fullmatch(name)) and linear.group(2) == "a":
            module = linear.group(1)
            merged[f"{module}.weight"] = (
                weight(f"{module}.weight") + (adapters[f"{module}.lora_b"].float() @ a.float()) * scale
            )
    return merged


def _linear(name: str, layout: HFLayout) -> tuple[str, str]:
    """An nn.Linear's adapter `name` (`<module>.lora_a` / `.lora_b`) -> (the HF name of the module, "a" or "b");
    ValueError for one the layout has no place for."""
    linear = _LINEAR.fullmatch(name)
    hf_weight = layout.to_hf(f"{linear.group(1)}.weight") if linear and is_adapter(name) else None
    if hf_weight is None or not hf_weight.endswith(".weight"):
        raise ValueError(f"{name} adapts no weight of the {layout.family} layout")
    return hf_weight.removesuffix(".weight"), linear.group(2)
