"""Token dispatchers over `torch.distributed` collectives (any backend): all-to-all expert parallelism
(`ExpertParallel`, `ExpertTensorParallel`), and the tensor-parallel experts' local dispatcher (`TensorParallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed._functional_collectives import (
    AsyncCollectiveTensor,
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.expert_parallel.dispatcher import (
    EAGER_PERMUTATION,
    DispatchState,
    ExpertTokens,
    LocalTokenDispatcher,
    TokenPermutation,
)
from torchtitan.distributed.tensor_parallel import sum_grad_over
from torchtitan.kernels.permute import PermutePlan, expert_major_order

__all__ = ["AllToAllTokenDispatcher", "TensorParallelTokenDispatcher"]


class TensorParallelTokenDispatcher(LocalTokenDispatcher):
    """ep == 1, experts sharded over tp on the hidden dim: all tokens stay here; their gradient is summed over tp."""

    def __init__(self, num_experts: int, score_before_experts: bool, tp_mesh: DeviceMesh):
        super().__init__(num_experts, score_before_experts)
        self.tp_mesh = tp_mesh

    def dispatch_preprocess(self, x, topk_idx, topk_weights):
        # the tokens' gradient, not the token copies': the same sum over tp in 1 / top_k of the rows
        return super().dispatch_preprocess(sum_grad_over(x, self.tp_mesh), topk_idx, topk_weights)


@dataclass
class AllToAllDispatchState(DispatchState):
    plan: PermutePlan  # the local batch's (N, k) slots <-> the send buffer's rows (sorted by global expert)
    topk_weights: torch.Tensor  # (N, k) fp32
    input_splits: list[int] | None = None  # rows this rank sends to each ep rank
    output_splits: list[int] | None = None  # rows this rank receives from each ep rank


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Expert parallelism with variable-size all-to-alls (`torch.distributed`, any backend).

    dispatch_preprocess   token copies sorted by global expert (= by destination rank), counted per expert
    token_dispatch        all-to-all of the counts, one host copy of the split sizes, all-to-all of the rows
    dispatch_postprocess  received rows (rank-major), one token each, ordered by local expert for the experts
    combine_preprocess    nothing: the experts return the received rows' outputs, rank-major
    token_combine         the reverse all-to-all
    combine_postprocess   back to the tokens, weight, sum over top-k (as without EP)

    etp_mesh: the experts are also tensor-parallel over these ranks (`ExpertTensorParallel`).
    """

    def __init__(
        self,
        num_experts: int,
        score_before_experts: bool,
        ep_mesh: DeviceMesh,
        etp_mesh: DeviceMesh | None = None,
        permutation: TokenPermutation = EAGER_PERMUTATION,
    ):
        super().__init__(num_experts, score_before_experts)
        self.permutation = permutation
        """The send buffer's two gathers (eager or compiled)."""
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.etp_mesh = etp_mesh

    def dispatch_preprocess(self, x, topk_idx, topk_weights):
        order, counts = self.expert_order(topk_idx)
        weights = topk_weights if self.score_before_experts else None
        # the send buffer: copies grouped by global expert, unpadded
        rows, plan = self.permutation.to_experts(x, order, counts, topk_idx.shape[1], weights, None, x.dtype)
        if self.etp_mesh is not None:
            rows = sum_grad_over(rows, self.etp_mesh)
        return rows, counts, AllToAllDispatchState(plan, topk_weights)

    def token_dispatch(self, prepared):
        rows, counts, state = prepared
        with torch.no_grad():
            # (ep * L,): row r = counts this rank receives from ep rank r for each of its L local experts
            received_counts = _wait(all_to_all_single(counts, None, None, group=self.group))
            # one host sync for both split lists: a variable-size all-to-all needs them on the host
            splits = torch.stack([counts.view(self.ep, -1).sum(1), received_counts.view(self.ep, -1).sum(1)]).cpu()
            input_splits, output_splits = splits.tolist()
        received = _wait(all_to_all_single_autograd(rows, output_splits, input_splits, self.group))
        return received, received_counts.view(self.ep, -1), state, input_splits, output_splits

    def dispatch_postprocess(self, dispatched):
        received, received_counts, state, input_splits, output_splits = dispatched
        ep, num_local = received_counts.shape
        # local expert id of every received row (rank-major: source rank, then expert)
        local_ids = torch.repeat_interleave(
            torch.arange(num_local, device=received.device).repeat(ep),
            received_counts.reshape(-1),
            output_size=received.shape[0],
        )
        local_order = expert_major_order(local_ids, num_local)
        tokens = ExpertTokens(received, local_order, received_counts.sum(0), 1, None, None, None)
        return tokens, replace(state, input_splits=input_splits, output_splits=output_splits)

    def combine_preprocess(self, expert_output, state):
        return expert_output

    def token_combine(self, prepared, state):
        return _wait(all_to_all_single_autograd(prepared, state.input_splits, state.output_splits, self.group))

    def combine_postprocess(self, combined, state):
        """combined (rows, dim) in the send buffer's order -> sum_k g_{t,k} FFN_k(x_t): (N, dim) fp32."""
        weights = None if self.score_before_experts else state.topk_weights
        top_k = state.topk_weights.shape[1]
        return self.permutation.from_experts(combined, state.plan, top_k, weights, torch.float32)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective here, on the current stream, rather than at its first use."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor
