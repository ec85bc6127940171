"""LoRA fine-tuning (`[lora]`): low-rank adapters on a frozen MoE transformer, in `peft`'s layout.

A target weight W (out, in) computes W x + s B (A x) with A (r, in), B (out, r) and s = alpha / r; B starts at zero,
so the adapted model starts as the base. Targets (`lora.targets`), in the blocks of `model.layers` (MTP modules stay
frozen: transformers' models have none, so their adapters could not be exported):
- `attention`: every nn.Linear of each block's attention (MLA's wq or wq_a / wq_b, wkv_a, wkv_b, wo), as `LoRALinear`;
- `mlp`: the dense layers' FFNs and the shared experts (`FeedForward`'s w1, w2, w3), as `LoRALinear`;
- `experts`: the routed experts (`GroupedExperts.add_adapters`): per expert, one adapter on gate+up (w1 and w3
  stacked, as transformers' fused `gate_up_proj`) and one on down (w2), each a (E, ...) tensor sharded like the
  weights under EP, so the experts stay grouped GEMMs.
Every other parameter is frozen, and the routers' aux-loss-free bias stops updating: the base stays exactly the
release, which is what lets the adapters alone be exported and merged (`scripts/convert_hf.py`). Adapters are named
after what they adapt (`layers.0.attention.wq_a.lora_a`, `layers.1.moe.experts.lora_down_b`); the base's weights keep
their names, so its checkpoints load unchanged.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.config import ConfigError
from torchtitan.config.job_config import LoRA
from torchtitan.distributed.weight_init import canonical_fqn
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.moe import MoE

__all__ = ["LORA_TARGETS", "LoRALinear", "add_adapters", "init_adapters", "is_adapter"]

LORA_TARGETS = ("attention", "mlp", "experts")

ADAPTER_PREFIX = "lora_"
"""Every adapter parameter's own name starts so (`lora_a`, `lora_gate_up_b`, ...), and ends in `_a` or `_b`;
nothing else's does."""


class LoRALinear(nn.Linear):
    """An nn.Linear plus its adapter: out = W x + scale B (A x). `weight` keeps its key, so base weights load as
    before; `lora_a` (r, in) and `lora_b` (out, r) are the adapter (peft's lora_A / lora_B weights)."""

    lora_scale: float = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.lora_scale


def add_adapters(model: nn.Module, config: LoRA, frozen_dtype: torch.dtype) -> int:
    """Freeze every parameter of `model` (on any device, meta included), storing the floating-point ones in
    `frozen_dtype` (the compute dtype: they are never updated, so they need no fp32 master), and add fp32 adapters to
    `config.targets`; returns the adapters' parameter count. Raises ConfigError naming the fix for a rank no target
    matrix can take."""
    unknown = sorted(set(config.targets) - set(LORA_TARGETS))
    if unknown or not config.targets:
        raise ConfigError(
            f"lora.targets={config.targets}: choose among {', '.join(LORA_TARGETS)}, e.g. --lora.targets "
            "attention,mlp,experts"
        )
    for param in model.parameters():
        param.requires_grad_(False)
        if param.is_floating_point():
            param.data = param.data.to(frozen_dtype)
    scale = config.alpha / config.rank
    for block in model.layers.values():
        for linear_name, linear in _target_linears(block, config.targets):
            _check_rank(config.rank, linear_name, min(linear.in_features, linear.out_features))
            _adapt_linear(linear, config.rank, scale)
        moe = getattr(block, "moe", None)
        if isinstance(moe, MoE):
            moe.load_balance_coeff = None  # the selection bias is the base's: it must not move
            if "experts" in config.targets:
                experts = moe.experts
                hidden_dim, dim = experts.w1.shape[1:]
                _check_rank(config.rank, "the routed experts", min(hidden_dim, dim))
                if experts.use_grouped_mm and config.rank % 8:
                    raise ConfigError(
                        f"lora.rank={config.rank}: the routed experts' grouped GEMMs need a rank that is a multiple "
                        "of 8 (16-byte rows); pass e.g. --lora.rank 16"
                    )
                experts.add_adapters(config.rank, scale)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _target_linears(block: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """(name, nn.Linear) of the block's targets: the attention's linears and every FeedForward's (dense FFN,
    shared experts)."""
    linears = []
    if "attention" in targets:
        linears += [(f"attention.{n}", m) for n, m in block.attention.named_children() if type(m) is nn.Linear]
    if "mlp" in targets:
        for name, module in block.named_modules():
            if isinstance(module, FeedForward):
                linears += [(f"{name}.{n}", m) for n, m in module.named_children() if type(m) is nn.Linear]
    return linears


def _check_rank(rank: int, what: str, smallest_dim: int) -> None:
    if rank > smallest_dim:
        raise ConfigError(
            f"lora.rank={rank} is larger than the smaller dim of {what} ({smallest_dim}): a rank above it adds nothing "
            f"a full update would not; pass --lora.rank {smallest_dim} or less"
        )


def _adapt_linear(linear: nn.Linear, rank: int, scale: float) -> None:
    linear.__class__ = LoRALinear
    factory = {"device": linear.weight.device, "dtype": torch.float32}
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, **factory))
    linear.lora_b = nn.Parameter(torch.empty(linear.out_features, rank, **factory))
    linear.lora_scale = scale


def is_adapter(name: str) -> bool:
    """Whether the parameter or state-dict key `name` is an adapter's."""
    return name.rpartition(".")[2].startswith(ADAPTER_PREFIX)


@torch.no_grad()
def init_adapters(model_parts: list[nn.Module], seed: int) -> None:
    """A: peft's default (kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B: zeros. Each A is drawn
    whole from a generator seeded by `seed` and its name and each rank keeps its shard, so every layout (FSDP, EP)
    starts from the same adapters."""
    for part in model_parts:
        for name, param in part.named_parameters():
            if not is_adapter(name):
                continue
            if name.endswith("_b"):
                param.zero_()
                continue
            fan_in = param.shape[-1]
            generator = torch.Generator().manual_seed(seed + _name_hash(canonical_fqn(name)))
            bound = 1.0 / math.sqrt(fan_in)
            full = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            if isinstance(param, DTensor):
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
