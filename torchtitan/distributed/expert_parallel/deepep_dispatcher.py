"""`DeepEPTokenDispatcher`: the `TokenDispatcher` stages over `torch.ops.deepep.*`.

    dispatch_preprocess   dtypes/contiguity DeepEP needs (int64 ids, fp32 weights)
    token_dispatch        deepep::dispatch: each token once to every rank holding one of its experts
    dispatch_postprocess  received tokens with the op's local-expert-major slots, as the experts' `ExpertTokens`
    combine_preprocess    nothing: the experts return per received token the weighted sum over this rank's experts
    token_combine         deepep::combine: send back, sum per source token
    combine_postprocess   nothing left to do (output is already (num_tokens, dim))

No host syncs here: the data-dependent sizes come out of the op (unbacked symbols under torch.compile), or, with
`sync_free`, are worst-case sizes whose padding rows get no expert. With a `capacity_factor` each rank sends every
rank at most its share of that many copies (`drop_past_capacity`), so the experts' rows are bounded by the factor
times the balanced load instead of EP times it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchtitan.distributed.deepep import ops
from torchtitan.distributed.deepep.buffer import get_buffer
from torchtitan.distributed.expert_parallel.dispatcher import DispatchState, ExpertTokens, TokenDispatcher

__all__ = ["DeepEPDispatchState", "DeepEPDispatched", "DeepEPTokenDispatcher", "drop_past_capacity"]


@dataclass
class DeepEPDispatched:
    """Output of the communication stage (see `ops.py` for shapes)."""

    recv_x: torch.Tensor  # (num_recv, dim)
    recv_topk_idx: torch.Tensor  # (num_recv, top_k) local expert ids, -1 elsewhere
    recv_topk_weights: torch.Tensor  # (num_recv, top_k) fp32
    tokens_per_local_expert: torch.Tensor  # (num_local_experts,) int64
    permuted_slots: torch.Tensor  # (num_copies,) int64, flat (num_recv, top_k) slots, local-expert-major
    handle: list[torch.Tensor]


@dataclass
class DeepEPDispatchState(DispatchState):
    handle: list[torch.Tensor]


class DeepEPTokenDispatcher(TokenDispatcher):
    def __init__(
        self,
        group_name: str,
        num_experts: int,
        score_before_experts: bool = False,
        *,
        sync_free: bool = False,
        capacity_factor: float | None = None,
        fp8: bool = False,
    ):
        super().__init__(num_experts, score_before_experts)
        self.group_name = group_name
        self.sync_free = sync_free
        """Worst-case receive sizes, no host wait (ops.py); the padding rows get no expert."""
        self.capacity_factor = capacity_factor
        """The copies a rank receives are at most this factor x (local tokens x top_k): copies past a destination's
        share are dropped before the dispatch, and a sync-free dispatch keeps only that many rows
        (`parallelism.deepep_sync_free_capacity_factor`)."""
        self.fp8 = fp8
        """Tokens sent as FP8 with one scale per 128 channels (ops.py, `quantize.float8_dispatch`)."""

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        topk_idx, topk_weights = topk_idx.to(torch.int64), topk_weights.float()
        if self.capacity_factor is not None:
            topk_idx, topk_weights = drop_past_capacity(
                topk_idx, topk_weights, self.num_experts, self._num_ranks, self._capacity(*topk_idx.shape)
            )
        return x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()

    @property
    def _num_ranks(self) -> int:
        return get_buffer(self.group_name).world_size

    def _capacity(self, num_tokens: int, top_k: int) -> int:
        """Copies one rank may send each rank: its share of capacity_factor x its balanced load."""
        return math.ceil(self.capacity_factor * num_tokens * top_k / self._num_ranks)

    def token_dispatch(self, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> DeepEPDispatched:
        x, topk_idx, topk_weights = prepared
        return DeepEPDispatched(
            *ops.dispatch(x, topk_idx, topk_weights, self.num_experts, self.group_name, self.sync_free, self.fp8)
        )

    def dispatch_postprocess(self, dispatched: DeepEPDispatched) -> tuple[ExpertTokens, DeepEPDispatchState]:
        weights = dispatched.recv_topk_weights
        before = self.score_before_experts
        slots = dispatched.permuted_slots
        if self.sync_free and self.capacity_factor is not None:
            # the received copies come first and are at most ranks x capacity: the rows past that are padding
            num_ranks = self._num_ranks
            num_tokens = dispatched.recv_x.shape[0] // num_ranks  # sync-free: ranks x each rank's token count
            slots = slots[: num_ranks * self._capacity(num_tokens, weights.shape[1])]
        tokens = ExpertTokens(
            dispatched.recv_x,
            slots,
            dispatched.tokens_per_local_expert,
            weights.shape[1],
            weights if before else None,
            None if before else weights,
            dispatched.recv_x.dtype,  # combine sends the tokens' dtype
        )
        return tokens, DeepEPDispatchState(dispatched.handle)

    def combine_preprocess(self, expert_output: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        """(num_recv, dim): per received token the fp32 sum of its copies' outputs, weighted unless the weights were
        applied before the experts, in the tokens' dtype (the experts' `ExpertTokens.out_dtype`)."""
        return expert_output

    def token_combine(self, prepared: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        combined, _ = ops.combine(prepared, state.handle, self.group_name)
        return combined

    def combine_postprocess(self, combined: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        return combined


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
