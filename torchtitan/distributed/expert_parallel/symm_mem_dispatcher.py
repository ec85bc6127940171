"""`SymmMemTokenDispatcher`: `AllToAllTokenDispatcher`'s layout with the split sizes kept on the device.

    dispatch_preprocess   token copies sorted by global expert (= by destination rank), counted per expert; copies
                          `apply_capacity` dropped (expert -1) last and in no count
    token_dispatch        the counts' exchange, then an all-to-all-v of the rows into a static number of rows:
                          ranks x local copies (the worst case), or ranks x the capacity per rank
    dispatch_postprocess  received rows (rank-major) ordered by local expert; the padding rows past the counts' sum
                          last, in no expert's group
    combine_preprocess    nothing: the experts return one row per received row
    token_combine         the reverse all-to-all-v, into the send buffer's rows
    combine_postprocess   back to the tokens, weight, sum over top-k (as without EP)

No host syncs (`distributed/symm_mem_all_to_all.py`): every size is static, so no MoE layer waits on its host.
`SymmMemExpertParallel` is the ParallelStyle that creates the EP group's symmetric buffers and installs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed import symm_mem_all_to_all as ops
from torchtitan.distributed.expert_parallel.dispatcher import (
    EAGER_PERMUTATION,
    DispatchState,
    ExpertTokens,
    LocalTokenDispatcher,
    TokenPermutation,
    capacity_per_rank,
)
from torchtitan.distributed.expert_parallel.styles import EXPERTS_ON_EP_RANKS, distribute_experts
from torchtitan.kernels.permute import PermutePlan, expert_major_order

__all__ = ["SymmMemDispatchState", "SymmMemExpertParallel", "SymmMemTokenDispatcher", "receive_rows"]


@dataclass
class SymmMemDispatchState(DispatchState):
    plan: PermutePlan  # the local batch's (N, k) slots <-> the send buffer's rows (sorted by global expert)
    topk_weights: torch.Tensor  # (N, k) fp32
    send_splits: torch.Tensor | None = None  # (ep,) rows this rank sends each rank
    recv_splits: torch.Tensor | None = None  # (ep,) rows this rank receives from each rank


class SymmMemTokenDispatcher(LocalTokenDispatcher):
    def __init__(
        self,
        num_experts: int,
        score_before_experts: bool,
        ep_mesh: DeviceMesh,
        capacity_factor: float | None = None,
        permutation: TokenPermutation = EAGER_PERMUTATION,
    ):
        super().__init__(num_experts, score_before_experts)
        self.group_name = ep_mesh.get_group().group_name
        self.ep = ep_mesh.size()
        self.capacity_factor = capacity_factor
        """Each rank sends every rank at most this factor x its balanced share of copies (`apply_capacity`), so a
        rank receives at most ranks x that many rows; None: the worst case, ranks x local copies
        (`parallelism.expert_parallel_capacity_factor`)."""
        self.permutation = permutation
        """The send buffer's two gathers (eager or compiled)."""

    @property
    def num_ranks(self) -> int:
        return self.ep

    def dispatch_preprocess(self, x, topk_idx, topk_weights):
        order, counts = self.expert_order(topk_idx)
        weights = topk_weights if self.score_before_experts else None
        # the send buffer: copies grouped by global expert, unpadded; dropped copies' rows (zero) last, not sent
        rows, plan = self.permutation.to_experts(x, order, counts, topk_idx.shape[1], weights, None, x.dtype)
        return rows, counts, SymmMemDispatchState(plan, topk_weights)

    def token_dispatch(self, prepared):
        rows, counts, state = prepared
        with torch.no_grad():
            # (ep, L): row r = the copies rank r sends this rank for each of its L local experts
            received_counts = ops.exchange_counts(counts, self.group_name).view(self.ep, -1)
            send_splits, recv_splits = counts.view(self.ep, -1).sum(1), received_counts.sum(1)
        out_rows = receive_rows(*state.topk_weights.shape, self.ep, self.capacity_factor)
        received = ops.all_to_all_v(rows, send_splits, recv_splits, self.group_name, out_rows, ops.DISPATCH_LANE)
        return received, received_counts, replace(state, send_splits=send_splits, recv_splits=recv_splits)

    def dispatch_postprocess(self, dispatched):
        received, received_counts, state = dispatched
        ep, num_local = received_counts.shape
        # the (source rank, local expert) block of every received row; ep * num_local past the last: padding
        block_ends = received_counts.reshape(-1).cumsum(0)
        rows = torch.arange(received.shape[0], device=received.device)
        block = torch.searchsorted(block_ends, rows, right=True)
        local_ids = torch.where(block < ep * num_local, block % num_local, -1)
        local_order = expert_major_order(local_ids, num_local)
        return ExpertTokens(received, local_order, received_counts.sum(0), 1, None, None, None), state

    def combine_preprocess(self, expert_output, state):
        return expert_output

    def token_combine(self, prepared, state):
        num_rows = state.topk_weights.numel()  # the send buffer's rows: N x top_k
        return ops.all_to_all_v(
            prepared, state.recv_splits, state.send_splits, self.group_name, num_rows, ops.COMBINE_LANE
        )

    def combine_postprocess(self, combined, state):
        """combined (N x top_k, dim) in the send buffer's order -> sum_k g_{t,k} FFN_k(x_t): (N, dim) fp32."""
        weights = None if self.score_before_experts else state.topk_weights
        top_k = state.topk_weights.shape[1]
        return self.permutation.from_experts(combined, state.plan, top_k, weights, torch.float32)


def receive_rows(num_tokens: int, top_k: int, num_ranks: int, capacity_factor: float | None) -> int:
    """Rows a rank receives at most when every rank routes num_tokens x top_k copies: all of them (None), or the
    capacity per rank `apply_capacity` leaves (no more than all of them)."""
    num_copies = num_tokens * top_k
    if capacity_factor is None:
        return num_ranks * num_copies
    return num_ranks * min(num_copies, capacity_per_rank(capacity_factor, num_tokens, top_k, num_ranks))


class SymmMemExpertParallel(ParallelStyle):
    """On an `MoE`: experts sharded on dim 0 over the 1-D EP mesh; tokens exchanged with all-to-all-v over symmetric
    memory, split sizes on the device. On CUDA the group's symmetric buffers are created here, for micro-batches of up
    to `max_tokens` tokens per rank whose rows are at most `itemsize` bytes an element. capacity_factor:
    `parallelism.expert_parallel_capacity_factor`."""

    def __init__(
        self,
        max_tokens: int,
        capacity_factor: float | None = None,
        itemsize: int = 2,
        permutation: TokenPermutation = EAGER_PERMUTATION,
    ):
        super().__init__()
        self.permutation = permutation
        self.max_tokens = max_tokens
        self.capacity_factor = capacity_factor
        self.itemsize = itemsize

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.device_type == "cuda":
            dim = module.experts.w1.shape[2]  # (E, hidden, dim)
            if dim % 16:
                raise ValueError(
                    f"expert_parallel_comm_backend='symm_mem': the model dim {dim} must be a multiple of 16 (NVSHMEM's "
                    "all-to-all-v splits each peer's rows into up to 32 equal parts of bytes); use another "
                    "--parallelism.expert_parallel_comm_backend for this shape"
                )
            ep, top_k = device_mesh.size(), module.top_k
            send_rows = self.max_tokens * top_k
            recv_rows = receive_rows(self.max_tokens, top_k, ep, self.capacity_factor)
            ops.get_or_create_buffers(
                device_mesh.get_group(), send_rows, recv_rows, dim * self.itemsize, module.num_experts
            )
        distribute_experts(module.experts, device_mesh, EXPERTS_ON_EP_RANKS)
        module.dispatcher = SymmMemTokenDispatcher(
            module.num_experts,
            module.score_before_experts,
            device_mesh,
            capacity_factor=self.capacity_factor,
            permutation=self.permutation,
        )
        return module
