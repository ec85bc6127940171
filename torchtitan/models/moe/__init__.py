"""Reusable DeepSeek-V3 MoE layer (router, grouped experts, shared experts, load balancing)."""

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.moe import ExpertBiasHook, MoE, set_tokens_per_optimizer_step

__all__ = ["ExpertBiasHook", "GroupedExperts", "MoE", "MoEArgs", "set_tokens_per_optimizer_step"]
