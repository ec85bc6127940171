"""ParallelStyles for the routed experts (`GroupedExperts`) and the other parts of an MoE layer.

`GroupedExperts.forward(routed_input, num_tokens_per_expert)` takes token copies sorted expert-major:
routed_input (T, dim), num_tokens_per_expert (E,). The styles here wrap that call with hooks installed by
`distribute_module`, so the experts module itself never changes:

- `ExpertParallel` (ep mesh): weights Shard(0) (each rank owns E / ep experts). Input hook = dispatch:
  all-to-all of the per-expert counts, host copy of the split sizes, variable-size all-to-all of the tokens
  (rank-major on arrival), permutation to local-expert-major. Output hook = combine: inverse permutation and
  the reverse all-to-all.
- `ExpertTensorParallel` ([ep, etp] mesh): EP across ranks plus TP inside each expert: w1/w3 [Shard(0), Shard(1)]
  (column-wise), w2 [Shard(0), Shard(2)] (row-wise). Tokens are identical on the etp ranks, so the expert output
  is a partial sum over etp, reduced by the MoE module's output layout (reduce-scatter to the sequence shard).
- `TensorParallel` (tp mesh, ep == 1): TP inside experts, no dispatch.

State between dispatch and combine (split sizes, permutation) is kept on a stack in the style object: dispatch
pushes, combine pops. The experts' forward runs dispatch and combine back to back, so pairs always nest, also under
activation recomputation and pipeline micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.moe.row_gather import gather_rows

__all__ = [
    "ExpertParallel",
    "ExpertTensorParallel",
    "NoParallel",
    "ReplicateOverTokenShards",
    "TensorParallel",
    "SyncGradColumns",
    "permute_rank_major_to_expert_major",
]


@dataclass
class _DispatchState:
    input_splits: list[int]  # tokens this rank sends to each ep rank
    output_splits: list[int]  # tokens this rank receives from each ep rank
    expert_major_index: torch.Tensor  # (received,): position in the rank-major buffer of each expert-major row


class ExpertParallel(ParallelStyle):
    """Experts sharded on dim 0 over the ep mesh; tokens exchanged with all-to-all before and after."""

    def __init__(self) -> None:
        super().__init__()
        self._states: list[_DispatchState] = []

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        routed_input, local_counts, state = dispatch_tokens(routed_input, num_tokens_per_expert, mesh)
        self._states.append(state)
        return routed_input, local_counts

    def _combine(self, module: nn.Module, routed_output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return combine_tokens(routed_output, self._states.pop(), mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, partition_fn=self._partition_fn, input_fn=self._dispatch, output_fn=self._combine
        )


class ExpertTensorParallel(ExpertParallel):
    """EP x TP on the experts over a 2-D [ep, etp] mesh."""

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        # w1, w3: (E, hidden, dim) column-wise on hidden; w2: (E, dim, hidden) row-wise on hidden.
        placements = {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)], "w3": [Shard(0), Shard(1)]}
        for param_name, param in module.named_parameters(recurse=False):
            dist_param = distribute_tensor(param, mesh, placements[param_name])
            module.register_parameter(param_name, nn.Parameter(dist_param))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        # The tokens are replicated over etp, but each etp rank's gradient for them is a partial sum over its
        # hidden shard: declaring the gradient Partial all-reduces it over etp in backward.
        routed_input = DTensor.from_local(routed_input, mesh["etp"], (Replicate(),)).to_local(
            grad_placements=(Partial(),)
        )
        return super()._dispatch(module, (routed_input, num_tokens_per_expert), mesh["ep"])

    def _combine(self, module: nn.Module, routed_output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return super()._combine(module, routed_output, mesh["ep"])


class TensorParallel(ParallelStyle):
    """TP inside the experts when ep == 1: every rank holds all experts' hidden shard; output is partial."""

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        placements = {"w1": [Shard(1)], "w2": [Shard(2)], "w3": [Shard(1)]}
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, placements[param_name])))

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        routed_input, num_tokens_per_expert = inputs
        routed_input = DTensor.from_local(routed_input, mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
        return routed_input, num_tokens_per_expert

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn, input_fn=self._prepare_input)


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


def dispatch_tokens(
    routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor, mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor, _DispatchState]:
    """routed_input (T, dim) expert-major over all E experts -> (received (R, dim) local-expert-major,
    tokens per local expert (E / ep,), state for `combine_tokens`)."""
    ep = mesh.size()
    group = mesh.get_group()
    counts_dtype = num_tokens_per_expert.dtype
    with torch.no_grad():
        counts = num_tokens_per_expert.to(torch.int64)
        # (ep * L,): row r = counts this rank receives from ep rank r for each of its L local experts
        received_counts = all_to_all_single(counts, None, None, group=group)
        received_counts = torch.ops._c10d_functional.wait_tensor(received_counts)
        # one host sync for both split lists; variable-size all-to-all needs them on the host
        splits = torch.stack([counts.view(ep, -1).sum(1), received_counts.view(ep, -1).sum(1)]).cpu()
        input_splits, output_splits = splits.tolist()
        received_counts = received_counts.view(ep, -1)  # (ep, L)
        expert_major_index = permute_rank_major_to_expert_major(received_counts, sum(output_splits))
    received = all_to_all_single_autograd(routed_input, output_splits, input_splits, group)
    received = gather_rows(received, expert_major_index, unique=True)
    local_counts = received_counts.sum(0).to(counts_dtype)
    return received, local_counts, _DispatchState(input_splits, output_splits, expert_major_index)


def combine_tokens(routed_output: torch.Tensor, state: _DispatchState, mesh: DeviceMesh) -> torch.Tensor:
    """Inverse of `dispatch_tokens`: (R, dim) local-expert-major -> (T, dim) in the caller's original order."""
    rank_major = torch.empty_like(routed_output).index_copy(0, state.expert_major_index, routed_output)
    return all_to_all_single_autograd(rank_major, state.input_splits, state.output_splits, mesh.get_group())


def permute_rank_major_to_expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts (ep, L): tokens from source rank r for local expert e, laid out rank-major (r0e0, r0e1, ..., r1e0, ...).

    Returns index (total = sum(counts),) such that `buffer[index]` is expert-major (e0r0, e0r1, ..., e1r0, ...).
    """
    ep, num_local = counts.shape
    flat = counts.reshape(-1)
    segment_starts = torch.cumsum(flat, 0) - flat  # start of each (r, e) segment in the rank-major buffer
    expert_major = torch.arange(ep * num_local, device=counts.device).view(ep, num_local).t().reshape(-1)
    lengths = flat[expert_major]
    starts = segment_starts[expert_major]
    # position j of expert-major segment s maps to starts[s] + j
    out_starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(total, device=counts.device)
    offset_in_segment = positions - torch.repeat_interleave(out_starts, lengths, output_size=total)
    return torch.repeat_interleave(starts, lengths, output_size=total) + offset_in_segment
