"""Small ParallelStyles and autograd helpers for tensor parallelism beyond torch's Colwise/Rowwise/Sequence styles."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["NoParallel", "ReplicateOverTokenShards", "SyncGradColumns", "sum_grad_over"]


def sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; all-reduces x's gradient over `mesh` in backward. For tokens replicated over TP ranks
    whose gradient each rank computes only for its hidden shard of the experts (a partial sum)."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class NoParallel(ParallelStyle):
    """Weights and input replicated over the mesh (the router gate and norms under TP): the input is wrapped as a
    Replicate DTensor (its backward all-reduces a partial input gradient) and the output returned as a local tensor."""

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
    """Weights replicated over the mesh, input = this rank's token shard (dim 0 standing for the token dims), for the
    router gate and shared experts when EP borrows the tp ranks: the weight gradient becomes a Partial DTensor, which
    FSDP / the optimizer reduce."""

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (DTensor.from_local(inputs[0], mesh, (Shard(0),), run_check=False), *inputs[1:])


class SyncGradColumns(NoParallel):
    """`NoParallel` whose output columns [start:] feed every TP head, so their partial gradient is all-reduced in
    backward; columns before `start` feed a ColwiseParallel layer whose input hook already does. MLA's `wkv_a` output is
    [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], with k_pe broadcast to all heads."""

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
