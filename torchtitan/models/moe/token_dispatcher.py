"""Token dispatchers: how an MoE layer moves token copies to its experts and back, in explicit stages.

    MoE.forward:  route -> dispatcher.dispatch -> experts(rows, group_ends) -> dispatcher.combine -> + shared experts

    dispatch:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    combine:   combine_preprocess  -> token_combine  -> combine_postprocess

`token_dispatch` / `token_combine` are the communication stages; the others are local compute. Every stage takes
and returns explicit values, and what combine needs from dispatch travels in the `DispatchState` that dispatch
returns (no module state, no FIFO), so a scheduler can run one micro-batch's communication on another stream
while another micro-batch computes (`models/moe/overlap.py`).

`LocalTokenDispatcher` (no expert parallelism) is the MoE's default; `parallelize` installs another one through
the expert-parallel ParallelStyles: all-to-all (`distributed/expert_parallel.py`) or DeepEP
(`distributed/deepep/`). The model never changes with the backend. Every backend moves its tokens into the
experts' padded rows and back with the same two gathers (`permute_to_experts`, `unpermute_tokens`: `permute.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.models.moe.experts import ExpertRows
from torchtitan.models.moe.permute import PermutePlan, permute_tokens, plan_permutation, unpermute_tokens

__all__ = [
    "DispatchState",
    "LocalDispatchState",
    "LocalTokenDispatcher",
    "TokenDispatcher",
    "expert_major_order",
    "permute_to_experts",
]


def expert_major_order(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Positions of the flattened `expert_ids` (-1: no expert) sorted by expert, stably (so within one expert the
    original order is kept); the -1 entries come last. Returns (expert_ids.numel(),) int64.

    The one ordering every backend uses: token copies of a local batch, copies received from other ranks
    (all-to-all), and DeepEP's received (token, local expert) slots.
    """
    flat = expert_ids.reshape(-1)
    keys = torch.where(flat >= 0, flat, num_experts)
    return torch.argsort(keys, stable=True)


def permute_to_experts(
    x: torch.Tensor,
    order: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None,
    alignment: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, PermutePlan]:
    """x (T, dim), order (C,) slots of (T, top_k) in expert-major order -> (rows, plan): the copies in padded
    expert-major rows (`permute.py`), scaled by `weights` (T, top_k) if given, and the plan that maps them back.
    Every backend's permutation; `compile_moe` swaps in a compiled copy shared by all layers."""
    plan = plan_permutation(order, x.shape[0] * top_k, tokens_per_expert, alignment)
    return permute_tokens(x, plan, top_k, weights, dtype), plan


@dataclass
class DispatchState:
    """What combine needs from dispatch. Backends subclass it; dropping it (and the autograd graph) frees it all."""


class TokenDispatcher(ABC):
    """Moves token copies from top-k routing to expert-major rows of this rank's experts, and back.

    dispatch(x (N, dim), topk_idx (N, k) global expert ids, topk_weights (N, k) fp32, layout) -> expert_input
    (rows, dim) in the experts' `layout` (padded local-expert-major groups, `ExpertRows`), group_ends (local
    experts,) int32, state;
    combine(expert_output (rows, dim), state) -> (N, dim) in fp32 or x's dtype: per token, the routing-weighted sum
    of its copies' outputs.
    """

    backend: str = ""
    """Name of the `parallelism.expert_parallel_comm_backend` behind it ('local' when nothing is exchanged)."""
    permute_to_experts = staticmethod(permute_to_experts)
    """The gather into the experts' rows, every backend's; `compile_moe` swaps in a compiled copy shared by all
    layers."""
    unpermute_tokens = staticmethod(unpermute_tokens)
    """The gather back with the weighted top-k sum; `compile_moe` swaps in a compiled copy shared by all layers."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layout: ExpertRows
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        prepared = self.dispatch_preprocess(x, topk_idx, topk_weights)
        return self.dispatch_postprocess(self.token_dispatch(prepared), layout)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        prepared = self.combine_preprocess(expert_output, state)
        return self.combine_postprocess(self.token_combine(prepared, state), state)

    @abstractmethod
    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """Local: put tokens and routing into the form the communication needs."""

    @abstractmethod
    def token_dispatch(self, prepared: Any) -> Any:
        """Communication: send token copies to the ranks holding their experts."""

    @abstractmethod
    def dispatch_postprocess(
        self, dispatched: Any, layout: ExpertRows
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Local: received tokens into the experts' rows -> (expert_input, group_ends, state)."""

    @abstractmethod
    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState) -> Any:
        """Local: undo the expert ordering, reduce what can be reduced before sending back."""

    @abstractmethod
    def token_combine(self, prepared: Any, state: DispatchState) -> Any:
        """Communication: return the results to the tokens' source ranks."""

    @abstractmethod
    def combine_postprocess(self, combined: Any, state: DispatchState) -> torch.Tensor:
        """Local: final layout (N, dim)."""


@dataclass
class LocalDispatchState(DispatchState):
    plan: PermutePlan  # the local batch's (N, k) slots <-> the rows its copies occupy
    topk_weights: torch.Tensor  # (N, k) fp32


class LocalTokenDispatcher(TokenDispatcher):
    """All experts on this rank: copy each token once per chosen expert into padded expert-major rows, and back.

    Subclasses that exchange the sorted copies with other ranks (all-to-all) override the communication stages
    and the local re-ordering around them.
    """

    backend = "local"

    def __init__(self, num_experts: int, score_before_experts: bool = False):
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts

    def expert_order(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_idx (N, k) -> the slots sorted by global expert (N * k,), tokens per global expert (E,)."""
        flat_idx = topk_idx.reshape(-1)
        # scatter_add, not bincount: bincount syncs with the host on CUDA to size its output
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=topk_idx.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx)
        )
        return expert_major_order(topk_idx, self.num_experts), counts

    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        return x, topk_idx, topk_weights

    def token_dispatch(self, prepared: Any) -> Any:
        return prepared

    def dispatch_postprocess(
        self, dispatched: Any, layout: ExpertRows
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        x, topk_idx, topk_weights = dispatched
        order, counts = self.expert_order(topk_idx)
        weights = topk_weights if self.score_before_experts else None
        rows, plan = self.permute_to_experts(
            x, order, counts, topk_idx.shape[1], weights, layout.alignment, layout.dtype
        )
        return rows, plan.group_ends, LocalDispatchState(plan, topk_weights)

    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return expert_output

    def token_combine(self, prepared: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return prepared

    def combine_postprocess(self, combined: torch.Tensor, state: LocalDispatchState) -> torch.Tensor:
        """combined (rows, dim) as dispatch laid them out -> sum_k g_{t,k} FFN_k(x_t): (N, dim) fp32."""
        weights = None if self.score_before_experts else state.topk_weights
        return self.unpermute_tokens(combined, state.plan, state.topk_weights.shape[1], weights, torch.float32)
