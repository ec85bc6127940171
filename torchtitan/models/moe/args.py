"""Arguments of one MoE layer, shared by the base `MoE`, `DeepEPMoE` and the model args."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn


@dataclass
class MoEArgs:
    num_experts: int = 8
    """Routed experts."""

    num_shared_experts: int = 1
    """Shared experts, fused into one SwiGLU FFN of width `num_shared_experts * hidden_dim`."""

    top_k: int = 1
    """Routed experts per token."""

    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Router score function, computed in fp32."""

    route_norm: bool = False
    """Renormalize the top-k scores to sum to one."""

    route_scale: float = 1.0
    """Multiply the (normalized) top-k scores by this factor."""

    score_before_experts: bool = False
    """Apply the routing score to the expert input (True) or to the expert output (False)."""

    num_expert_groups: int | None = None
    """Group-limited routing: experts are split into this many groups; None disables it."""

    num_limited_groups: int | None = None
    """Group-limited routing: tokens may pick experts only from this many top groups."""

    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """Group-limited routing: a group scores the sum of its two best (biased) affinities (DeepSeek-V3's `noaux_tc`)
    or its best one (DeepSeek-V2's `group_limited_greedy`)."""

    use_grouped_mm: bool = True
    """Use torch._grouped_mm for the routed experts (False: a per-expert loop, for reference/debug)."""

    load_balance_coeff: float | None = 1e-3
    """Aux-loss-free balancing: bias step size; None disables the bias update."""

    seq_aux_loss_coeff: float = 0.0
    """Optional sequence-wise auxiliary balance loss weight; 0 disables it."""

    global_aux_loss_coeff: float = 0.0
    """Global-batch auxiliary balance loss weight (Qwen3-MoE's `router_aux_loss_coef`, 0.001; load_balance.py):
    every MoE layer's loss E * sum_i f_i P_i, the expert loads f counted over the data-parallel ranks and the step's
    micro-batches so far; 0 disables it."""

    force_load_balance: bool = False
    """Round-robin token-to-expert assignment (benchmarking only; set from debug.moe_force_load_balance)."""


def count_active_params(model: nn.Module, moe_args: MoEArgs) -> tuple[int, int]:
    """(parameters of `model`, those one token computes with but the token embedding: of the routed experts (every
    `.moe.experts.` tensor, MTP modules' too) top_k / num_experts): what a model's FLOPs per token count (6 per
    parameter: forward, the input's gradient, the weight's). A frozen parameter (LoRA's base) counts 2/3: its
    backward computes no weight gradient. Works on DTensor-sharded models (global numel)."""
    nparams = routed_expert_params = embedding_params = 0
    frozen_discount = 0.0
    for name, param in model.named_parameters():
        nparams += param.numel()
        routed = ".moe.experts." in f".{name}"  # layers.N.moe.experts and mtp.K.moe.experts
        if routed:
            routed_expert_params += param.numel()
        elif name.startswith("tok_embeddings."):
            embedding_params += param.numel()
            continue
        if not param.requires_grad:
            frozen_discount += param.numel() * (moe_args.top_k / moe_args.num_experts if routed else 1.0) / 3
    inactive = routed_expert_params * (moe_args.num_experts - moe_args.top_k) // moe_args.num_experts
    return nparams, nparams - inactive - embedding_params - round(frozen_discount)
