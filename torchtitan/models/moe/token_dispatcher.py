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

__all__ = [
    "DispatchState",
    "LocalDispatchState",
    "LocalTokenDispatcher",
    "TokenDispatcher",
    "copy_weights",
    "expert_major_order",
    "gather_token_copies",
    "sum_token_copies",
]


def expert_major_order(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Positions of the flattened `expert_ids` (-1: no expert) sorted by expert, stably (so within one expert the
    original order is kept); the -1 entries come last. Returns (expert_ids.numel(),) int64.

    The one permutation every backend uses: token copies of a local batch, copies received from other ranks
    (all-to-all), and DeepEP's received (token, local expert) slots.
    """
    flat = expert_ids.reshape(-1)
    keys = torch.where(flat >= 0, flat, num_experts)
    return torch.argsort(keys, stable=True)


def gather_token_copies(
    x: torch.Tensor, slots: torch.Tensor, top_k: int, topk_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """x (tokens, dim), slots (copies,) flat `token * top_k + k` slots in expert-major order -> the token copies in
    that order (copies, dim), scaled by their routing weight if `topk_weights` (tokens, top_k) is given.

    Every backend's expert input: a local batch's tokens, or the tokens DeepEP delivered to this rank."""
    copies = gather_rows(x, slots // top_k, unique=False)
    if topk_weights is not None:
        copies = (copies.float() * copy_weights(topk_weights, slots)).to(x.dtype)
    return copies


def sum_token_copies(
    copies: torch.Tensor, token_order: torch.Tensor, topk_weights: torch.Tensor, apply_weights: bool
) -> torch.Tensor:
    """copies (tokens * top_k, dim) in expert-major order (`token_order`, as `expert_major_order` gave it) -> per
    token the fp32 sum of its top_k copies (tokens, dim), weighted by `topk_weights` (tokens, top_k) if
    `apply_weights`. Unsorts with a scatter and sums in a fixed order (deterministic, unlike an atomic index_add);
    compiled, the unsort is one pass and the weighted sum another."""
    num_tokens, top_k = topk_weights.shape
    unsorted = copies.new_empty(copies.shape).index_copy(0, token_order, copies)
    unsorted = unsorted.view(num_tokens, top_k, -1).float()  # (tokens, top_k, dim)
    if apply_weights:
        unsorted = unsorted * topk_weights.unsqueeze(-1)
    return unsorted.sum(dim=1)


def copy_weights(topk_weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(tokens, top_k) fp32 routing weights -> (copies, 1), the weight of each copy in `slots` order."""
    return topk_weights.reshape(-1).index_select(0, slots).unsqueeze(-1)


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
    gather_token_copies = staticmethod(gather_token_copies)
    """The expert input's gather, every backend's; `compile_moe` swaps in a compiled copy shared by all layers."""

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
    sum_token_copies = staticmethod(sum_token_copies)
    """The combine's unsort and weighted sum; `compile_moe` swaps in a compiled copy shared by all layers."""

    def __init__(self, num_experts: int, score_before_experts: bool = False):
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        """-> rows (N * k, dim) sorted by global expert, tokens per global expert (E,), state."""
        top_k = topk_idx.shape[1]
        token_order = expert_major_order(topk_idx, self.num_experts)  # (N * k,)
        weights = topk_weights if self.score_before_experts else None
        rows = self.gather_token_copies(x, token_order, top_k, weights)  # (N * k, dim)
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
        return self.sum_token_copies(combined, state.token_order, state.topk_weights, not self.score_before_experts)
