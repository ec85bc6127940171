"""`DeepEPTokenDispatcher`: the `TokenDispatcher` stages over `torch.ops.deepep.*`, and `DeepEPExpertParallel`, the
ParallelStyle that creates the EP group's buffer and installs it.

    dispatch_preprocess   dtypes/contiguity DeepEP needs (int64 ids, fp32 weights)
    token_dispatch        deepep::dispatch: each token once to every rank holding one of its experts
    dispatch_postprocess  received tokens with the op's local-expert-major slots, as the experts' `ExpertTokens`
    combine_preprocess    nothing: the experts return per received token the weighted sum over this rank's experts
    token_combine         deepep::combine: send back, sum per source token
    combine_postprocess   nothing left to do (output is already (num_tokens, dim))

No host syncs here: the data-dependent sizes come out of the op (unbacked symbols under torch.compile), or, with
`sync_free`, are worst-case sizes whose padding rows get no expert. With a `capacity_factor` each rank sends every
rank at most its share of that many copies (`apply_capacity`, before the dispatch), so the experts' rows are bounded
by the factor times the balanced load instead of EP times it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.deepep.buffer import get_buffer, get_or_create_buffer
from torchtitan.distributed.expert_parallel.dispatcher import (
    DispatchState,
    ExpertTokens,
    TokenDispatcher,
    capacity_per_rank,
)
from torchtitan.distributed.expert_parallel.styles import EXPERTS_ON_EP_RANKS, distribute_experts

__all__ = ["DeepEPDispatchState", "DeepEPDispatched", "DeepEPExpertParallel", "DeepEPTokenDispatcher"]


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
        share are dropped before the dispatch (`apply_capacity`), and a sync-free dispatch keeps only that many rows
        (`parallelism.expert_parallel_capacity_factor`)."""
        self.fp8 = fp8
        """Tokens sent as FP8 with one scale per 128 channels (ops.py, `deepep.float8_dispatch`)."""

    def dispatch_preprocess(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        topk_idx, topk_weights = topk_idx.to(torch.int64), topk_weights.float()
        return x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()

    @property
    def num_ranks(self) -> int:
        return get_buffer(self.group_name).world_size

    def token_dispatch(self, prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> DeepEPDispatched:
        x, topk_idx, topk_weights = prepared
        return DeepEPDispatched(
            *torch.ops.deepep.dispatch(
                x, topk_idx, topk_weights, self.num_experts, self.group_name, self.sync_free, self.fp8
            )
        )

    def dispatch_postprocess(self, dispatched: DeepEPDispatched) -> tuple[ExpertTokens, DeepEPDispatchState]:
        weights = dispatched.recv_topk_weights
        before = self.score_before_experts
        slots = dispatched.permuted_slots
        if self.sync_free and self.capacity_factor is not None:
            # the received copies come first and are at most ranks x capacity: the rows past that are padding
            num_ranks = self.num_ranks
            num_tokens = dispatched.recv_x.shape[0] // num_ranks  # sync-free: ranks x each rank's token count
            slots = slots[
                : num_ranks * capacity_per_rank(self.capacity_factor, num_tokens, weights.shape[1], num_ranks)
            ]
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
        combined, _ = torch.ops.deepep.combine(prepared, state.handle, self.group_name, None)
        return combined

    def combine_postprocess(self, combined: torch.Tensor, state: DeepEPDispatchState) -> torch.Tensor:
        return combined


class DeepEPExpertParallel(ParallelStyle):
    """On an `MoE` (parallelize makes it a `DeepEPMoE`): experts sharded on dim 0 over the 1-D EP mesh, tokens exchanged
    with DeepEP through the group's buffer, created here. num_sms, sync_free, capacity_factor, fp8: `deepep.num_sms`,
    `deepep.sync_free_dispatch`, `parallelism.expert_parallel_capacity_factor`, `deepep.float8_dispatch`."""

    def __init__(
        self, *, num_sms: int = 64, sync_free: bool = False, capacity_factor: float | None = None, fp8: bool = False
    ):
        super().__init__()
        self.num_sms = num_sms
        self.sync_free = sync_free
        self.capacity_factor = capacity_factor
        self.fp8 = fp8

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        dim = module.experts.w1.shape[2]  # (E, hidden, dim)
        buffer = get_or_create_buffer(group, dim, device_type=device_mesh.device_type, num_sms=self.num_sms)
        if self.sync_free and buffer.layout.name == "internode":
            raise ValueError(
                "deepep.sync_free_dispatch: DeepEP's worst-case receive sizes are intranode only and this EP group "
                "spans nodes; drop --deepep.sync_free_dispatch"
            )
        distribute_experts(module.experts, device_mesh, EXPERTS_ON_EP_RANKS)
        module.dispatcher = DeepEPTokenDispatcher(
            group.group_name,
            module.num_experts,
            module.score_before_experts,
            sync_free=self.sync_free,
            capacity_factor=self.capacity_factor,
            fp8=self.fp8,
        )
        return module
