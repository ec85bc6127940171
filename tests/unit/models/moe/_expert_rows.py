"""Run GroupedExperts on plain expert-major rows: pad them the way every dispatcher does, and unpad the output."""

import torch

from torchtitan.distributed.expert_parallel.dispatcher import ExpertTokens
from torchtitan.kernels.float8 import Float8Weights
from torchtitan.kernels.permute import PermutePlan, permute_tokens, plan_permutation, unpermute_tokens
from torchtitan.models.moe.experts import GroupedExperts, run_experts_grouped_mm


def pad_rows(
    x: torch.Tensor, counts: torch.Tensor, alignment: int, dtype: torch.dtype
) -> tuple[torch.Tensor, PermutePlan]:
    """x (T, dim) expert-major, counts (E,) -> the experts' padded rows (P, dim) in `dtype` and their plan; rows of x
    past sum(counts) belong to no expert."""
    plan = plan_permutation(torch.arange(x.shape[0], device=x.device), x.shape[0], counts, alignment)
    return permute_tokens(x, plan, 1, None, dtype), plan


def run_on_rows(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """experts on x (T, dim) expert-major with `counts` rows per expert -> (T, dim) in x.dtype, zero past the
    routed rows."""
    return experts(expert_major_tokens(x, counts))


def expert_major_tokens(x: torch.Tensor, counts: torch.Tensor) -> ExpertTokens:
    """x (T, dim) already expert-major, `counts` rows per expert, as the experts' tokens (one copy each)."""
    return ExpertTokens(x, torch.arange(x.shape[0], device=x.device), counts, 1, None, None, x.dtype)


def run_fp8_experts_on_rows(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    float8_weights: tuple[Float8Weights, Float8Weights] | None = None,
) -> torch.Tensor:
    """`run_on_rows` for FP8 experts as a function of tensors (what a compile test compiles): pad, grouped GEMMs,
    unpad. float8_weights: the weights quantized already (as `GroupedExperts` passes them from its caches)."""
    rows, plan = pad_rows(x, counts, 16, torch.bfloat16)
    out = run_experts_grouped_mm(rows, plan.group_ends, w1, w2, w3, True, float8_weights)
    return unpermute_tokens(out, plan, 1, None, x.dtype)


def expert_of_padded_row(group_ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows,) the local expert whose group holds each padded row (rows past the last group: the last expert)."""
    rows = torch.arange(num_rows, device=group_ends.device)
    return torch.searchsorted(group_ends.long(), rows, right=True).clamp_max(group_ends.numel() - 1)
