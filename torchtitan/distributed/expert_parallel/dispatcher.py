"""Token dispatchers: how an MoE layer moves token copies to its experts and back, in explicit stages.

    dispatch:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    combine:   combine_preprocess  -> token_combine  -> combine_postprocess

`token_dispatch` / `token_combine` communicate; the others compute locally. What combine needs from dispatch travels
in the `DispatchState` that dispatch returns (no module state). `LocalTokenDispatcher` (no EP) is the default; the
ParallelStyles of `styles.py` install the others. A dispatcher is never changed after it is built.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.kernels.permute import PermutePlan, expert_major_order, permute_to_experts, unpermute_tokens

__all__ = [
    "EAGER_PERMUTATION",
    "DispatchState",
    "ExpertTokens",
    "LocalTokenDispatcher",
    "TokenDispatcher",
    "TokenPermutation",
    "capacity_per_rank",
    "drop_past_capacity",
    "run_on_expert_rows",
]


@dataclass
class ExpertTokens:
    """The token copies this rank's experts take: tokens plus an expert-major order of their (token, k) slots. The
    experts lay the copies out in their rows themselves (`run_on_expert_rows`), so the gather, the experts and the sum
    back run as one compiled region."""

    x: torch.Tensor  # (T, dim) tokens; token t's copies are slots t * top_k + j
    order: torch.Tensor  # (C,) int64 slots, local-expert-major; the first sum(counts) are routed, the rest not
    counts: torch.Tensor  # (E_local,) copies per local expert
    top_k: int
    weights: torch.Tensor | None  # (T, top_k) fp32 routing weights applied to the copies before the experts
    out_weights: torch.Tensor | None  # (T, top_k) fp32 routing weights of the per-token sum after the experts
    out_dtype: torch.dtype | None  # the per-token sums' dtype; None: the experts' output dtype


def run_on_expert_rows(
    tokens: ExpertTokens,
    rows_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    alignment: int,
    row_dtype: torch.dtype,
) -> torch.Tensor:
    """tokens -> (T, dim): the copies in padded expert-major rows of `row_dtype` (groups aligned to `alignment`),
    rows_fn(rows, group_ends) on them, and per token the (weighted) sum of its copies' outputs."""
    rows, plan = permute_to_experts(
        tokens.x, tokens.order, tokens.counts, tokens.top_k, tokens.weights, alignment, row_dtype
    )
    out = rows_fn(rows, plan.group_ends)
    return unpermute_tokens(out, plan, tokens.top_k, tokens.out_weights, tokens.out_dtype or out.dtype)


@dataclass(frozen=True)
class TokenPermutation:
    """The two gathers of the all-to-all dispatcher's send buffer, with the signatures of `kernels/permute.py`'s
    `permute_to_experts` and `unpermute_tokens`: eager, or compiled regions shared by a model's MoE layers
    (`distributed/compile.py`)."""

    to_experts: Callable[..., tuple[torch.Tensor, PermutePlan]] = permute_to_experts
    from_experts: Callable[..., torch.Tensor] = unpermute_tokens


EAGER_PERMUTATION = TokenPermutation()


@dataclass
class DispatchState:
    """What combine needs from dispatch. Backends subclass it; dropping it (and the autograd graph) frees it all."""


class TokenDispatcher(ABC):
    """Moves token copies from top-k routing to this rank's experts, and back.

    dispatch(x (N, dim), topk_idx (N, k) global expert ids, topk_weights (N, k) fp32) -> (the `ExpertTokens` of
    this rank's experts, state);
    combine(expert_output (T, dim) per token of the ExpertTokens, state) -> (N, dim) in fp32 or x's dtype: per
    token, the routing-weighted sum of its copies' outputs.
    The routing dispatch takes is `apply_capacity`'s (the MoE layer calls it first).
    """

    capacity_factor: float | None = None
    """Set on capacity-bounded dispatchers: a rank sends each EP rank at most this factor x its balanced share of
    its token copies (`apply_capacity`); None: every copy is sent."""

    def __init__(self, num_experts: int, score_before_experts: bool = False):
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts

    @property
    def num_ranks(self) -> int:
        """The EP ranks the experts are spread over."""
        return 1

    def apply_capacity(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_idx, topk_weights (N, k) -> the routing this dispatcher sends: with a `capacity_factor`, the copies past
        each destination rank's capacity masked (id -1, weight 0; `drop_past_capacity`), otherwise unchanged."""
        if self.capacity_factor is None:
            return topk_idx, topk_weights
        capacity = capacity_per_rank(self.capacity_factor, *topk_idx.shape, self.num_ranks)
        return drop_past_capacity(topk_idx, topk_weights, self.num_experts, self.num_ranks, capacity)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[ExpertTokens, DispatchState | None]:
        prepared = self.dispatch_preprocess(x, topk_idx, topk_weights)
        return self.dispatch_postprocess(self.token_dispatch(prepared))

    def combine(self, expert_output: torch.Tensor, state: DispatchState | None) -> torch.Tensor:
        prepared = self.combine_preprocess(expert_output, state)
        return self.combine_postprocess(self.token_combine(prepared, state), state)

    @abstractmethod
    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """Local: put tokens and routing into the form the communication needs."""

    @abstractmethod
    def token_dispatch(self, prepared: Any) -> Any:
        """Communication: send token copies to the ranks holding their experts."""

    @abstractmethod
    def dispatch_postprocess(self, dispatched: Any) -> tuple[ExpertTokens, DispatchState | None]:
        """Local: what was received, as the experts' tokens -> (tokens, state)."""

    @abstractmethod
    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState | None) -> Any:
        """Local: the experts' output (T, dim) into the form the communication needs."""

    @abstractmethod
    def token_combine(self, prepared: Any, state: DispatchState | None) -> Any:
        """Communication: return the results to the tokens' source ranks."""

    @abstractmethod
    def combine_postprocess(self, combined: Any, state: DispatchState | None) -> torch.Tensor:
        """Local: final layout (N, dim)."""


class LocalTokenDispatcher(TokenDispatcher):
    """All experts on this rank: the local tokens go to the experts as they are, with their expert-major order; the
    experts' output is already the per-token sum. Exchanging subclasses override the communication stages and the
    local re-ordering around them."""

    def expert_order(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_idx (N, k), -1 for a dropped copy -> the slots sorted by global expert, dropped ones last (N * k,),
        tokens per global expert (E,)."""
        flat_idx = topk_idx.reshape(-1)
        bins = torch.where(flat_idx >= 0, flat_idx, self.num_experts)  # dropped copies: one more bin
        # scatter_add, not bincount: bincount syncs with the host on CUDA to size its output
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=topk_idx.device).scatter_add_(
            0, bins, torch.ones_like(bins)
        )
        return expert_major_order(topk_idx, self.num_experts), counts[: self.num_experts]

    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        return x, topk_idx, topk_weights

    def token_dispatch(self, prepared: Any) -> Any:
        return prepared

    def dispatch_postprocess(self, dispatched: Any) -> tuple[ExpertTokens, None]:
        x, topk_idx, topk_weights = dispatched
        order, counts = self.expert_order(topk_idx)
        before = self.score_before_experts
        weights, out_weights = (topk_weights, None) if before else (None, topk_weights)
        return ExpertTokens(x, order, counts, topk_idx.shape[1], weights, out_weights, torch.float32), None

    def combine_preprocess(self, expert_output: torch.Tensor, state: None) -> torch.Tensor:
        return expert_output

    def token_combine(self, prepared: torch.Tensor, state: None) -> torch.Tensor:
        return prepared

    def combine_postprocess(self, combined: torch.Tensor, state: None) -> torch.Tensor:
        """sum_k g_{t,k} FFN_k(x_t): (N, dim) fp32, as the experts returned it."""
        return combined


def capacity_per_rank(capacity_factor: float, num_tokens: int, top_k: int, num_ranks: int) -> int:
    """Copies one rank may send each rank: its share of capacity_factor x its balanced load (num_tokens x top_k)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_ranks)


def drop_past_capacity(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_ranks: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx (T, K) global expert ids, topk_weights (T, K) -> both with the copies past `capacity` per destination
    rank masked (id -1, weight 0), the lowest routing weights first; ties keep the earlier token. No host sync, and
    only 1-D scans (a scan along the long dim of a (T*K, ranks) tensor runs serially on CUDA)."""
    flat_idx = topk_idx.reshape(-1)
    dest = torch.where(flat_idx >= 0, flat_idx // (num_experts // num_ranks), num_ranks)  # masked: one more column
    # the copies grouped by destination, heaviest first within each: two stable sorts
    by_weight = torch.argsort(topk_weights.reshape(-1), descending=True, stable=True)
    order = by_weight[torch.argsort(dest[by_weight].to(torch.int16), stable=True)]
    per_dest = torch.zeros(num_ranks + 1, dtype=torch.int64, device=dest.device).scatter_add_(
        0, dest, torch.ones_like(dest)
    )
    first = per_dest.cumsum(0) - per_dest  # where each destination's group starts in `order`
    in_order = torch.arange(order.numel(), device=dest.device) - first[dest[order]]
    position = torch.empty_like(in_order).scatter_(0, order, in_order)  # each copy's rank within its destination
    keep = ((position < capacity) & (flat_idx >= 0)).view_as(topk_idx)
    return torch.where(keep, topk_idx, -1), torch.where(keep, topk_weights, 0.0)
