"""The tiny MoE layer the expert-parallel exchange tests build on every rank (the DeepEP and symm_mem ones)."""

import torch

from torchtitan.models.moe import MoE, MoEArgs

DIM, HIDDEN, TOP_K = 16, 32, 3


def build_moe(cls=MoE, score_before_experts: bool = False, use_grouped_mm: bool = False) -> MoE:
    """8 routed experts (top-3, sigmoid scores, normalized) and one shared one, seeded: the same weights on every
    rank and for every class."""
    torch.manual_seed(0)
    args = MoEArgs(
        num_experts=8,
        num_shared_experts=1,
        top_k=TOP_K,
        score_func="sigmoid",
        route_norm=True,
        score_before_experts=score_before_experts,
        use_grouped_mm=use_grouped_mm,
    )
    moe = cls(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.02)
    return moe
