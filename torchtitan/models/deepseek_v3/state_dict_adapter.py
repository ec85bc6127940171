"""Convert between our state dict and the on-disk Hugging Face DeepSeek-V2/V3 format (one tensor per expert).

Our routed experts are stacked (E, out, in) tensors moe.experts.w1/w2/w3; HF stores mlp.experts.{j}.gate_proj /
down_proj / up_proj with the same per-expert layout, so converting is stacking / unstacking along dim 0. RoPE needs
no permutation: HF DeepSeek checkpoints keep DeepSeek's interleaved layout, which `apply_rotary_emb` uses.
The router's selection bias moe.expert_bias is mlp.gate.e_score_correction_bias (DeepSeek-V3's; V2 has none).
The config.json side (model args <-> HF fields) is hf_config.py.

DeepSeek's own releases are FP8: `is_fp8_weight` names the weights stored as float8_e4m3fn with block scales, which
`HFCheckpoint` dequantizes as it reads them (`hf_sources` says which HF tensors make each of ours).
"""

import dataclasses
import logging
import re
from collections.abc import Collection, Iterable

import torch

from torchtitan.components.hf_checkpoint import HFSource
from torchtitan.models.moe.hf_state_dict import (
    TRUNK_KEY_MAP,
    HFLayout,
    HFSources,
    HFStateDictAdapter,
)

from .args import DeepSeekV3ModelArgs
from .hf_config import SELECTION_BIAS_IGNORED, hf_config_from_model_args, selection_bias_ignored_by_transformers
from .model import MTPBlock

logger = logging.getLogger(__name__)

# our key -> HF key, with "{}" standing for the layer index: the trunk's, then this model's own
_KEY_MAP = {
    **TRUNK_KEY_MAP,
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wq_a.weight": "model.layers.{}.self_attn.q_a_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_a_layernorm.weight",
    "layers.{}.attention.wq_b.weight": "model.layers.{}.self_attn.q_b_proj.weight",
    "layers.{}.attention.wkv_a.weight": "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight",
    "layers.{}.attention.kv_norm.weight": "model.layers.{}.self_attn.kv_a_layernorm.weight",
    "layers.{}.attention.wkv_b.weight": "model.layers.{}.self_attn.kv_b_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.moe.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias",
    "layers.{}.moe.shared_experts.w1.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    "layers.{}.moe.shared_experts.w2.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
    "layers.{}.moe.shared_experts.w3.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
    # multi-token prediction modules (ours: mtp.{k}, renamed to layers.{n_layers + k} around this map)
    "layers.{}.enorm.weight": "model.layers.{}.enorm.weight",
    "layers.{}.hnorm.weight": "model.layers.{}.hnorm.weight",
    "layers.{}.eh_proj.weight": "model.layers.{}.eh_proj.weight",
    "layers.{}.head_norm.weight": "model.layers.{}.shared_head.norm.weight",
}
# In DeepSeek-V3's checkpoint each MTP layer also carries copies of the shared embedding and output head.
_MTP_SHARED_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
# The weights DeepSeek's FP8 releases (V3, R1) store as float8_e4m3fn with block scales: every linear layer of
# attention, the dense MLPs and the shared and routed experts, the MTP layer's included. Embeddings, the output head
# (and an MTP layer's copies of both), norms, the router gate and its bias and an MTP layer's eh_proj stay bf16/fp32.
_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight"
)
# The tensors only an MTP layer has (a transformer layer past the model's is another model's)
_MTP_ONLY_KEY = re.compile(r"model\.layers\.\d+\.(enorm|hnorm|eh_proj|embed_tokens|shared_head)\.")
# Training-only state with no HF counterpart; a load from HF starts it at zeros.
_OURS_ONLY = ("tokens_per_expert",)


class DeepSeekV3StateDictAdapter(HFStateDictAdapter):
    """DeepSeek-V2/V3's layout (`_KEY_MAP`), with the MTP modules as the layers after the model's."""

    optional_prefixes = ("mtp.",)  # a checkpoint without MTP modules: get_model_args decides whether to build them
    layout = HFLayout("DeepSeek-V2/V3", _KEY_MAP, _OURS_ONLY, _FP8_WEIGHT)
    config_from_args = staticmethod(hf_config_from_model_args)
    biased_model_alternative = "sample it as it is with scripts/generate.py"
    model_args: DeepSeekV3ModelArgs

    def selection_bias_ignored(self) -> str | None:
        """A softmax-routed model exports as deepseek_v2, whose transformers class has no selection bias."""
        return SELECTION_BIAS_IGNORED if selection_bias_ignored_by_transformers(self.model_args) else None

    def hf_layout(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full (or meta) state dict under HF keys, routed experts unstacked: MTP module k becomes
        model.layers.{n_layers + k}, with copies of the embedding and the output head."""
        hf_state_dict = {}
        n_layers = self.model_args.n_layers
        for k in range(self.model_args.mtp_layers):
            for hf_name, ours in _MTP_SHARED_COPIES.items():
                if ours in state_dict:
                    hf_state_dict[f"model.layers.{n_layers + k}.{hf_name}"] = state_dict[ours]
        state_dict = {_mtp_to_layer_key(key, n_layers): value for key, value in state_dict.items()}
        return hf_state_dict | self.layout.state_dict_to_hf(state_dict)

    def hf_sources(self, hf_keys: Iterable[str]) -> dict[str, HFSource]:
        """Where each of our tensors comes from among the HF tensor names `hf_keys` (FP8 scales left out: the
        reader dequantizes their weights). The mtp_layers layers after the n_layers transformer layers become the MTP
        modules (without their copies of the embedding and head); later MTP layers are left out with a log line, a
        later transformer layer is a ValueError (a deeper model than these args), and so is a tensor that has no
        place in the model. An MTP module with no tensor in the checkpoint is left out (keeps its init); a checkpoint
        without e_score_correction_bias (DeepSeek-V2) gets a zero expert_bias, and token counts start at zero."""
        n_layers, num_experts = self.model_args.n_layers, self.model_args.moe_args.num_experts
        n_blocks = n_layers + self.model_args.mtp_layers
        sources = HFSources(self.layout)
        held_layers = set()
        beyond: dict[int, list[str]] = {}  # layer past the model's blocks -> its tensor names
        for key in hf_keys:
            if layer := re.match(r"model\.layers\.(\d+)\.(.*)", key):
                i, rest = int(layer.group(1)), layer.group(2)
                held_layers.add(i)
                if i >= n_blocks:
                    beyond.setdefault(i, []).append(key)
                    continue
                if i >= n_layers and rest in _MTP_SHARED_COPIES:
                    continue
            sources.add(key)

        _leave_out_layers_beyond(beyond, n_layers, self.model_args.mtp_layers)
        resolved = sources.resolve(num_experts)

        for i in range(self.model_args.n_dense_layers, n_blocks):
            if i >= n_layers and i not in held_layers:
                continue
            resolved.setdefault(f"layers.{i}.moe.expert_bias", HFSource())
            for name in _OURS_ONLY:
                resolved[f"layers.{i}.moe.{name}"] = HFSource()
        return {_layer_to_mtp_key(key, n_layers): source for key, source in resolved.items()}

    def args_for_checkpoint(
        self, keys: Collection[str], path: str, *, in_hf: bool, requested: bool, flag: str
    ) -> DeepSeekV3ModelArgs:
        """The args to build for starting from the checkpoint at `path` (tensor names `keys`, HF's if `in_hf`): these,
        with the MTP modules it holds (`mtp_layers_for_checkpoint`; `requested`: the user's `flag` asked for them)."""
        mtp_layers = mtp_layers_for_checkpoint(self.model_args, keys, path, in_hf=in_hf, requested=requested, flag=flag)
        return dataclasses.replace(self.model_args, mtp_layers=mtp_layers)


def is_fp8_weight(hf_key: str) -> bool:
    """Whether DeepSeek's FP8 releases store this HF weight as float8_e4m3fn with block scales."""
    return _FP8_WEIGHT.fullmatch(hf_key) is not None


def _is_mtp_layer(hf_keys: Iterable[str]) -> bool:
    """Whether an HF layer's tensor names are an MTP module's (it has a tensor only those have)."""
    return any(map(_MTP_ONLY_KEY.match, hf_keys))


def _leave_out_layers_beyond(beyond: dict[int, list[str]], n_layers: int, mtp_layers: int) -> None:
    """Checkpoint layers past the model's (`beyond`: layer -> tensor names): MTP layers the model does not build are
    left out, said in one line; a transformer layer there (no MTP-only tensor) means a deeper model: ValueError."""
    if blocks := sorted(i for i, keys in beyond.items() if not _is_mtp_layer(keys)):
        raise ValueError(
            f"transformer layers past the {n_layers} (and {mtp_layers} MTP) of the model shape given: "
            f"model.layers.{blocks[0]}.* to model.layers.{blocks[-1]}.* (a deeper model)"
        )
    if beyond:
        names = sorted(key for keys in beyond.values() for key in keys)
        logger.info(
            f"left out {len(beyond)} MTP layer(s) of the checkpoint that the model does not build (it has "
            f"{mtp_layers} MTP modules): {len(names)} tensors, e.g. {names[:3]}; more mtp_layers would load them"
        )


def mtp_layers_for_checkpoint(
    args: DeepSeekV3ModelArgs, keys: Collection[str], path: str, *, in_hf: bool, requested: bool, flag: str
) -> int:
    """The MTP depth to build for starting from the checkpoint at `path` (tensor names `keys`, HF's if `in_hf`) when
    args.mtp_layers (the HF config's, or the user's `flag` when `requested`) asks for MTP. transformers' save_pretrained
    writes no MTP tensors though its config defaults num_nextn_predict_layers to 1: a checkpoint holding none loads
    without MTP (0, with a warning) or, when `requested`, with fresh modules. A partial set raises ValueError.
    """
    if args.mtp_layers == 0:
        return 0
    n_layers, keys = args.n_layers, set(keys)
    adapter = DeepSeekV3StateDictAdapter(args)
    prefixes, held = [], []
    for k in range(args.mtp_layers):
        with torch.device("meta"):
            module = {f"mtp.{k}.{name}": t for name, t in MTPBlock(n_layers + k, args).state_dict().items()}
        prefix = f"model.layers.{n_layers + k}." if in_hf else f"mtp.{k}."
        prefixes.append(prefix)
        if not any(key.startswith(prefix) for key in keys):
            continue
        if in_hf and not _is_mtp_layer(key for key in keys if key.startswith(prefix)):
            raise ValueError(
                f"{path}: {prefix}* is a transformer layer, not an MTP module: the checkpoint is a deeper model than "
                f"the {n_layers} layers given; give its own model shape (its config.json)"
            )
        # the router's selection bias is optional in HF (a DeepSeek-V2 checkpoint has none; it loads as zeros)
        expected = set(adapter.hf_layout(module)) if in_hf else set(module)
        missing = sorted(key for key in expected - keys if not key.endswith("e_score_correction_bias"))
        if missing:
            raise ValueError(
                f"{path}: MTP layer {prefix}* is incomplete, it lacks {len(missing)} of its tensors, e.g. "
                f"{missing[:3]}; the checkpoint is corrupt: re-download or re-save it ({flag} 0 loads it without MTP)"
            )
        held.append(k)
    if len(held) == args.mtp_layers:
        return args.mtp_layers
    if held:
        raise ValueError(
            f"{path} holds {len(held)} of the {args.mtp_layers} MTP layers asked for ({prefixes[0]}* to "
            f"{prefixes[-1]}*); set {flag} {len(held)}, or re-save the checkpoint"
        )
    if requested:
        logger.warning(
            f"{path} holds no MTP tensors ({prefixes[0]}*): the {args.mtp_layers} MTP module(s) asked for with {flag} "
            "start freshly initialized"
        )
        return args.mtp_layers
    logger.warning(
        f"{path} holds no MTP tensors ({prefixes[0]}*) though the config's num_nextn_predict_layers asks for "
        f"{args.mtp_layers} (transformers' save_pretrained writes none): loading without MTP; set {flag} "
        f"{args.mtp_layers} to train freshly initialized MTP modules"
    )
    return 0


def _mtp_to_layer_key(key: str, n_layers: int) -> str:
    """mtp.{k}.<rest> -> layers.{n_layers + k}.<rest> (the HF numbering); other keys unchanged."""
    if match := re.fullmatch(r"mtp\.(\d+)\.(.*)", key):
        return f"layers.{n_layers + int(match.group(1))}.{match.group(2)}"
    return key


def _layer_to_mtp_key(key: str, n_layers: int) -> str:
    """layers.{i}.<rest> with i >= n_layers -> mtp.{i - n_layers}.<rest>; other keys unchanged."""
    if (match := re.fullmatch(r"layers\.(\d+)\.(.*)", key)) and int(match.group(1)) >= n_layers:
        return f"mtp.{int(match.group(1)) - n_layers}.{match.group(2)}"
    return key
