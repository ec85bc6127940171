"""`DeepEPTokenDispatcher`: the `TokenDispatcher` stages over `torch.ops.deepep.*`.

    dispatch_preprocess   dtypes/contiguity DeepEP needs (int64 ids, fp32 weights)
    token_dispatch        deepep::dispatch: each token once to every rank holding one of its experts
    dispatch_postprocess  received copies -> local-expert-major rows (index_select by the op's permuted_slots)
    combine_preprocess    back to received-token order, weighted sum over this rank's experts of each token
    token_combine         deepep::combine: send back, sum per source token
    combine_postprocess   nothing left to do (output is already (num_tokens, dim))

No host syncs here: the data-dependent sizes come out of the op (unbacked symbols under torch.compile), or, with
`sync_free`, are worst-case sizes with padding rows the experts skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.distributed.deepep import ops
from torchtitan.models.moe.token_dispatcher import DispatchState, TokenDispatcher, copy_weights

__all__ = [
    "DeepEPDispatchState",
    "DeepEPDispatched",
    "DeepEPTokenDispatcher",
    "sum_per_received_token",
]


def sum_per_received_token(
    expert_output: torch.Tensor,
    permuted_slots: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    apply_weights: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """expert_output (num_copies, dim) local-expert-major -> (num_recv, dim) in `dtype`: for each received token
    the fp32 sum of its copies' outputs, weighted by `recv_topk_weights` (num_recv, top_k) if `apply_weights`."""
    num_recv, top_k = recv_topk_weights.shape
    out = expert_output.float()
    if apply_weights:
        out = out * copy_weights(recv_topk_weights, permuted_slots)
    per_token = out.new_zeros((num_recv, out.shape[1])).index_add(0, permuted_slots // top_k, out)
    return per_token.to(dtype)


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
    permuted_slots: torch.Tensor  # (num_copies,)
    recv_topk_weights: torch.Tensor  # (num_recv, top_k) fp32
    dtype: torch.dtype  # of the tokens


class DeepEPTokenDispatcher(TokenDispatcher):
    backend = "deepep"
    sum_per_received_token = staticmethod(sum_per_received_token)
    """The combine's local sum; `compile_moe` swaps in a compiled copy shared by all layers."""

    def __init__(
        self,
        group_name: str,
        num_experts: int,
        score_before_experts: bool = False,
        sync_free: bool = False,
        fp8: bool = False,
    ):
        self.group_name = group_name
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts
        self.sync_free = sync_free
        """Worst-case receive sizes, no host wait (ops.py); the experts skip the padding rows."""
        self.fp8 = fp8
        """Tokens sent as FP8 with one scale per 128 channels (ops.py, `quantize.float8_dispatch`)."""

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x.contiguous(), topk_idx.to(torch.int64).contiguous(), topk_weights.float().contiguous()

    def token_dispatch(self, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> DeepEPDispatched:
        x, topk_idx, topk_weights = prepared
        return DeepEPDispatched(
            *ops.dispatch(x, topk_idx, topk_weights, self.num_experts, self.group_name, self.sync_free, self.fp8)
        )

    def dispatch_postprocess(
        self, dispatched: DeepEPDispatched
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPDispatchState]:
        top_k = dispatched.recv_topk_idx.shape[1]
        weights = dispatched.recv_topk_weights if self.score_before_experts else None
        expert_input = self.gather_token_copies(dispatched.recv_x, dispatched.permuted_slots, top_k, weights)
        state = DeepEPDispatchState(
            handle=dispatched.handle,
            permuted_slots=dispatched.permuted_slots,
            recv_topk_weights=dispatched.recv_topk_weights,
            dtype=dispatched.recv_x.dtype,
        )
        return expert_input, dispatched.tokens_per_local_expert, state

    def combine_preprocess(self, expert_output: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        return self.sum_per_received_token(
            expert_output, state.permuted_slots, state.recv_topk_weights, not self.score_before_experts, state.dtype
        )

    def token_combine(self, prepared: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        combined, _ = ops.combine(prepared, state.handle, self.group_name)
        return combined

    def combine_postprocess(self, combined: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        return combined
