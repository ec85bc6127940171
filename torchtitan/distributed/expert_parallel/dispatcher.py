"""Token dispatchers: how an MoE layer moves token copies to its experts and back, in explicit stages.

    dispatch:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    combine:   combine_preprocess  -> token_combine  -> combine_postprocess

`token_dispatch` / `token_combine` are the communication stages; the others are local compute. Every stage takes
and returns explicit values, and what combine needs from dispatch travels in the `DispatchState` that dispatch
returns (no module state, no FIFO), so a scheduler can run one micro-batch's communication on another stream
while another micro-batch computes (`models/moe/overlap.py`).

`LocalTokenDispatcher` (no expert parallelism) is the MoE's default; `parallelize` installs the one its backend
needs through the expert-parallel ParallelStyles (`styles.py`): all-to-all (`all_to_all.py`) or DeepEP
(`deepep_dispatcher.py`). A dispatcher is built with everything that shapes it and never changed afterwards. Every
backend moves its tokens into the experts' padded rows and back with the same two gathers, `TokenPermutation`:
eager, or the compiled regions `parallelize` creates once per model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.kernels.permute import PermutePlan, expert_major_order, permute_to_experts, unpermute_tokens

__all__ = [
    "EAGER_PERMUTATION",
    "DispatchState",
    "ExpertRows",
    "LocalDispatchState",
    "LocalTokenDispatcher",
    "TokenDispatcher",
    "TokenPermutation",
]


@dataclass(frozen=True)
class ExpertRows:
    """How the experts want their input rows: groups padded to `alignment` rows, in `dtype`."""

    alignment: int
    dtype: torch.dtype


@dataclass(frozen=True)
class TokenPermutation:
    """The two gathers around the experts, with the signatures of `kernels/permute.py`'s `permute_to_experts` and
    `unpermute_tokens`: eager, or compiled regions shared by a model's MoE layers (`distributed/compile.py`)."""

    to_experts: Callable[..., tuple[torch.Tensor, PermutePlan]] = permute_to_experts
    from_experts: Callable[..., torch.Tensor] = unpermute_tokens


EAGER_PERMUTATION = TokenPermutation()


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

    def __init__(self, num_experts: int, score_before_experts: bool, permutation: TokenPermutation):
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts
        self.permutation = permutation

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

    def __init__(
        self, num_experts: int, score_before_experts: bool = False, permutation: TokenPermutation = EAGER_PERMUTATION
    ):
        super().__init__(num_experts, score_before_experts, permutation)

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
        rows, plan = self.permutation.to_experts(
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
        return self.permutation.from_experts(combined, state.plan, state.topk_weights.shape[1], weights, torch.float32)
