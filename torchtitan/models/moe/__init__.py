"""Reusable DeepSeek-V3 MoE layer (router, grouped experts, shared experts, load balancing)."""

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.feed_forward import FeedForward
from torchtitan.models.moe.load_balance import update_expert_bias
from torchtitan.models.moe.moe import ExpertBiasHook, MoE
from torchtitan.models.moe.router import TokenChoiceTopKRouter

__all__ = [
    "ExpertBiasHook",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "TokenChoiceTopKRouter",
    "update_expert_bias",
]
