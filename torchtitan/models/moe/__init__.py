"""What every MoE transformer here shares: the MoE layer (router, grouped experts, shared experts, load balancing), the
transformer block, and how to parallelize and pipeline such a model."""

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.moe import ExpertBiasHook, MoE, set_tokens_per_optimizer_step

__all__ = ["ExpertBiasHook", "GroupedExperts", "MoE", "MoEArgs", "set_tokens_per_optimizer_step"]
