"""Token dispatchers: how an MoE layer moves token copies to its experts and back, in explicit stages.

    MoE.forward:  route -> dispatcher.dispatch -> experts(rows, counts) -> dispatcher.combine -> + shared experts

    dispatch:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    combine:   combine_preprocess  -> token_combine  -> combine_postprocess

`token_dispatch` / `token_combine` are the communication stages; the others are local compute. Every stage takes
and returns explicit values, and what combine needs from dispatch travels in the `DispatchState` that dispatch
returns (no module state, no FIFO), so a scheduler can run one micro-batch's communication on another stream
while another micro-batch computes (`models/moe/overlap.py`).

`LocalTokenDispatcher` (no expert parallelism) is the MoE's default; `parallelize` installs another one through
the expert-parallel ParallelStyles: all-to-all (`distributed/expert_parallel.py`) or DeepEP
(`distributed/deepep/`). The model never changes with the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.models.moe.row_gather import gather_rows

__all__ = ["DispatchState", "LocalDispatchState", "LocalTokenDispatcher", "TokenDispatcher", "expert_major_order"]


def expert_major_order(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Positions of the flattened `expert_ids` (-1: no expert) sorted by expert, stably (so within one expert the
    original order is kept); the -1 entries come last. Returns (expert_ids.numel(),) int64.

    The one permutation every backend uses: token copies of a local batch, copies received from other ranks
    (all-to-all), and DeepEP's received (token, local expert) slots.
    """
    flat = expert_ids.reshape(-1)
    keys = torch.where(flat >= 0, flat, num_experts)
    return torch.argsort(keys, stable=True)


@dataclass
class DispatchState:
    """What combine needs from dispatch. Backends subclass it; dropping it (and the autograd graph) frees it all."""


class TokenDispatcher(ABC):
    """Moves token copies from top-k routing to expert-major rows of this rank's experts, and back.

    dispatch(x (N, dim), topk_idx (N, k) global expert ids, topk_weights (N, k) fp32) -> expert_input
    (rows, dim) local-expert-major, tokens_per_local_expert (local experts,), state;
    combine(expert_output (rows, dim), state) -> (N, dim) in fp32 or x's dtype: per token, the routing-weighted sum
    of its copies' outputs.
    """

    backend: str = ""
    """Name of the `parallelism.expert_parallel_comm_backend` behind it ('local' when nothing is exchanged)."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        prepared = self.dispatch_preprocess(x, topk_idx, topk_weights)
        return self.dispatch_postprocess(self.token_dispatch(prepared))

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
    def dispatch_postprocess(self, dispatched: Any) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Local: order received tokens for the experts -> (expert_input, tokens_per_local_expert, state)."""

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
    token_order: torch.Tensor  # (N * k,): flat (token, k) choice of each expert-major row
    topk_weights: torch.Tensor  # (N, k) fp32


class LocalTokenDispatcher(TokenDispatcher):
    """All experts on this rank: copy each token once per chosen expert, grouped expert-major, and back.

    Subclasses that exchange the sorted copies with other ranks (all-to-all) override the communication stages
    and the local re-ordering around them.
    """

    backend = "local"

    def __init__(self, num_experts: int, score_before_experts: bool = False):
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        """-> rows (N * k, dim) sorted by global expert, tokens per global expert (E,), state."""
        top_k = topk_idx.shape[1]
        token_order = expert_major_order(topk_idx, self.num_experts)  # (N * k,)
        rows = gather_rows(x, token_order // top_k, unique=False)  # (N * k, dim)
        if self.score_before_experts:
            rows = (rows.float() * topk_weights.reshape(-1, 1)[token_order]).to(x.dtype)
        flat_idx = topk_idx.reshape(-1)
        # scatter_add, not bincount: bincount syncs with the host on CUDA to size its output
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx)
        )
        return rows, counts, LocalDispatchState(token_order, topk_weights)

    def token_dispatch(self, prepared: Any) -> Any:
        return prepared

    def dispatch_postprocess(self, dispatched: Any) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        return dispatched

    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return expert_output

    def token_combine(self, prepared: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return prepared

    def combine_postprocess(self, combined: torch.Tensor, state: LocalDispatchState) -> torch.Tensor:
        """combined (N * k, dim) sorted by global expert -> sum_k g_{t,k} FFN_k(x_t): (N, dim) fp32."""
        num_tokens, top_k = state.topk_weights.shape
        unsorted = combined.new_empty(combined.shape).index_copy(0, state.token_order, combined)
        unsorted = unsorted.view(num_tokens, top_k, -1).float()  # (N, k, dim)
        if not self.score_before_experts:
            unsorted = unsorted * state.topk_weights.unsqueeze(-1)
        return unsorted.sum(dim=1)
