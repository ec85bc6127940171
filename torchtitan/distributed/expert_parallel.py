"""ParallelStyles for the MoE layer: the routed experts' sharding plus the token dispatcher, and the other parts.

The expert styles are applied to an `MoE` module. Each shards `moe.experts` and installs `moe.dispatcher`, the
`TokenDispatcher` that moves token copies to the ranks holding their experts and back (see
`models/moe/token_dispatcher.py`); the experts module itself never changes and no hooks rewrite its arguments.

- `ExpertParallel` (ep mesh): weights Shard(0) (each rank owns E / ep experts); `AllToAllTokenDispatcher`.
- `ExpertTensorParallel` ([ep, etp] mesh): EP across ranks plus TP inside each expert: w1/w3 [Shard(0), Shard(1)]
  (column-wise), w2 [Shard(0), Shard(2)] (row-wise). Tokens are identical on the etp ranks, so the expert output
  is a partial sum over etp, reduced by the MoE module's output layout (reduce-scatter to the sequence shard).
- `TensorParallel` (tp mesh, ep == 1): TP inside experts, no token exchange.
- DeepEP: `DeepEPExpertParallel` in `distributed/deepep/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import (
    AsyncCollectiveTensor,
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.moe.permute import PermutePlan
from torchtitan.models.moe.token_dispatcher import LocalDispatchState, LocalTokenDispatcher, expert_major_order

__all__ = [
    "EXPERTS_ON_EP_RANKS",
    "AllToAllTokenDispatcher",
    "ExpertParallel",
    "ExpertTensorParallel",
    "NoParallel",
    "ReplicateOverTokenShards",
    "SyncGradColumns",
    "TensorParallel",
    "check_experts_divisible",
    "distribute_experts",
]


def _sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; all-reduces x's gradient over `mesh` in backward. For tokens replicated over TP ranks
    whose gradient each rank computes only for its hidden shard of the experts (a partial sum)."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class TensorParallelTokenDispatcher(LocalTokenDispatcher):
    """ep == 1, experts sharded over tp on the hidden dim: all tokens stay here; their gradient is summed over tp."""

    def __init__(self, num_experts: int, score_before_experts: bool, tp_mesh: DeviceMesh):
        super().__init__(num_experts, score_before_experts)
        self.tp_mesh = tp_mesh

    def dispatch_preprocess(self, x, topk_idx, topk_weights):
        # the tokens' gradient, not the token copies': the same sum over tp in 1 / top_k of the rows
        return super().dispatch_preprocess(_sum_grad_over(x, self.tp_mesh), topk_idx, topk_weights)


@dataclass
class AllToAllDispatchState(LocalDispatchState):
    input_splits: list[int]  # rows this rank sends to each ep rank
    output_splits: list[int]  # rows this rank receives from each ep rank
    received_plan: PermutePlan  # received rows (rank-major) <-> the local experts' rows


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Expert parallelism with variable-size all-to-alls (`torch.distributed`, any backend).

    dispatch_preprocess   token copies sorted by global expert (= by destination rank), counted per expert
    token_dispatch        all-to-all of the counts, one host copy of the split sizes, all-to-all of the rows
    dispatch_postprocess  received rows (rank-major) -> the local experts' padded rows
    combine_preprocess    back to rank-major
    token_combine         the reverse all-to-all
    combine_postprocess   back to the tokens, weight, sum over top-k (as without EP)

    etp_mesh: the experts are also tensor-parallel over these ranks (`ExpertTensorParallel`).
    """

    backend = "standard"

    def __init__(
        self, num_experts: int, score_before_experts: bool, ep_mesh: DeviceMesh, etp_mesh: DeviceMesh | None = None
    ):
        super().__init__(num_experts, score_before_experts)
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.etp_mesh = etp_mesh

    def dispatch_preprocess(self, x, topk_idx, topk_weights):
        order, counts = self.expert_order(topk_idx)
        weights = topk_weights if self.score_before_experts else None
        # the send buffer: copies grouped by global expert, unpadded
        rows, plan = self.permute_to_experts(x, order, counts, topk_idx.shape[1], weights, None, x.dtype)
        if self.etp_mesh is not None:
            rows = _sum_grad_over(rows, self.etp_mesh)
        return rows, counts, LocalDispatchState(plan, topk_weights)

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

    def dispatch_postprocess(self, dispatched, layout):
        received, received_counts, state, input_splits, output_splits = dispatched
        ep, num_local = received_counts.shape
        # local expert id of every received row (rank-major: source rank, then expert)
        local_ids = torch.repeat_interleave(
            torch.arange(num_local, device=received.device).repeat(ep),
            received_counts.reshape(-1),
            output_size=received.shape[0],
        )
        local_order = expert_major_order(local_ids, num_local)
        expert_input, received_plan = self.permute_to_experts(
            received, local_order, received_counts.sum(0), 1, None, layout.alignment, layout.dtype
        )
        all_to_all_state = AllToAllDispatchState(
            state.plan, state.topk_weights, input_splits, output_splits, received_plan
        )
        return expert_input, received_plan.group_ends, all_to_all_state

    def combine_preprocess(self, expert_output, state):
        return self.unpermute_tokens(expert_output, state.received_plan, 1, None, expert_output.dtype)

    def token_combine(self, prepared, state):
        return _wait(all_to_all_single_autograd(prepared, state.input_splits, state.output_splits, self.group))


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective here, on the current stream, rather than at its first use."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


class ExpertParallel(ParallelStyle):
    """On an `MoE`: experts sharded on dim 0 over the ep mesh; tokens exchanged with all-to-all."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_experts_divisible(module, device_mesh.size())
        distribute_experts(module.experts, device_mesh, EXPERTS_ON_EP_RANKS)
        module.dispatcher = AllToAllTokenDispatcher(module.num_experts, module.score_before_experts, device_mesh)
        return module


class ExpertTensorParallel(ParallelStyle):
    """On an `MoE`: EP x TP on the experts over a 2-D [ep, etp] mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_experts_divisible(module, device_mesh["ep"].size())
        # w1, w3: (E, hidden, dim) column-wise on hidden; w2: (E, dim, hidden) row-wise on hidden.
        placements = {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)], "w3": [Shard(0), Shard(1)]}
        distribute_experts(module.experts, device_mesh, placements)
        module.dispatcher = AllToAllTokenDispatcher(
            module.num_experts, module.score_before_experts, device_mesh["ep"], etp_mesh=device_mesh["etp"]
        )
        return module


class TensorParallel(ParallelStyle):
    """On an `MoE`, ep == 1: every rank holds all experts' hidden shard; the experts' output is partial."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_experts(module.experts, device_mesh, {"w1": [Shard(1)], "w2": [Shard(2)], "w3": [Shard(1)]})
        module.dispatcher = TensorParallelTokenDispatcher(module.num_experts, module.score_before_experts, device_mesh)
        return module


EXPERTS_ON_EP_RANKS = {"w1": [Shard(0)], "w2": [Shard(0)], "w3": [Shard(0)]}
"""Routed-expert weight placements over a 1-D EP mesh: each rank owns E / ep whole experts."""


def distribute_experts(experts: nn.Module, mesh: DeviceMesh, placements: dict[str, list]) -> None:
    """Replace the routed experts' w1/w2/w3 by DTensors with `placements` over `mesh` (every EP style uses it)."""
    for name, param in experts.named_parameters(recurse=False):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))


def check_experts_divisible(moe: nn.Module, ep: int) -> None:
    """Raise unless the MoE's experts split evenly over `ep` expert-parallel ranks."""
    if moe.num_experts % ep != 0:
        raise ValueError(f"{moe.num_experts} experts cannot be split evenly over {ep} expert-parallel ranks.")


class NoParallel(ParallelStyle):
    """Weights replicated over the mesh, input replicated: the module computes the same thing on every rank.

    The input is wrapped as a Replicate DTensor (its backward all-reduces a partial input gradient) and the output
    is returned as a local tensor.
    """

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        elif x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_replicate_params,
            input_fn=self._prepare_input,
            output_fn=self._prepare_output,
        )


class ReplicateOverTokenShards(NoParallel):
    """Weights replicated over the mesh, input = this rank's own tokens (sequence shard along dim 0).

    Used for the router gate and shared experts when EP borrows the tp ranks and the MoE layer runs on the local
    sequence shard: the weight gradient becomes a Partial DTensor (a sum over ranks), which FSDP / the optimizer
    reduce. Dim 0 is a stand-in for "the token dims": any token order gives the same weight gradient.
    """

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (DTensor.from_local(inputs[0], mesh, (Shard(0),), run_check=False), *inputs[1:])


class SyncGradColumns(NoParallel):
    """`NoParallel` whose output columns [start:] feed every TP head: their gradient arrives as a partial sum over
    the tp ranks (each rank holds some heads) and is all-reduced in backward. Columns before `start` feed a
    ColwiseParallel layer whose input hook already all-reduces their gradient.

    MLA's `wkv_a` output is [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]; k_pe is broadcast to all heads.
    """

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def _prepare_output(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        output = super()._prepare_output(module, output, mesh)
        return _AllReduceGradColumns.apply(output, self.start, mesh.get_group())


class _AllReduceGradColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        columns = grad[..., ctx.start :].contiguous()
        dist.all_reduce(columns, group=ctx.group)
        grad[..., ctx.start :] = columns
        return grad, None, None


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in module.named_parameters(recurse=False):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))
