"""ParallelStyles for an `MoE` layer's routed experts: each shards `moe.experts` (`distribute_experts`) and installs
the layer's token dispatcher; the experts module never changes and no hooks rewrite its arguments. Here the all-to-all
ones; an exchange backend's own style sits beside its dispatcher, in that one's module.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.expert_parallel.all_to_all import AllToAllTokenDispatcher, TensorParallelTokenDispatcher
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION, TokenPermutation

__all__ = ["EXPERTS_ON_EP_RANKS", "ExpertParallel", "ExpertTensorParallel", "TensorParallel", "distribute_experts"]

EXPERTS_ON_EP_RANKS = {"w1": [Shard(0)], "w2": [Shard(0)], "w3": [Shard(0)]}
"""Routed-expert weight placements over a 1-D EP mesh: each rank owns E / ep whole experts."""


class _ExpertStyle(ParallelStyle):
    def __init__(self, permutation: TokenPermutation = EAGER_PERMUTATION):
        super().__init__()
        self.permutation = permutation


class ExpertParallel(_ExpertStyle):
    """On an `MoE`: experts sharded on dim 0 over the ep mesh; tokens exchanged with all-to-all."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_experts(module.experts, device_mesh, EXPERTS_ON_EP_RANKS)
        module.dispatcher = AllToAllTokenDispatcher(
            module.num_experts, module.score_before_experts, device_mesh, permutation=self.permutation
        )
        return module


class ExpertTensorParallel(_ExpertStyle):
    """On an `MoE`: EP x TP on the experts over a 2-D [ep, etp] mesh. The experts' output is a partial sum over etp,
    reduced by the MoE module's output layout."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # w1, w3: (E, hidden, dim) column-wise on hidden; w2: (E, dim, hidden) row-wise on hidden.
        placements = {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)], "w3": [Shard(0), Shard(1)]}
        distribute_experts(module.experts, device_mesh, placements)
        module.dispatcher = AllToAllTokenDispatcher(
            module.num_experts,
            module.score_before_experts,
            device_mesh["ep"],
            etp_mesh=device_mesh["etp"],
            permutation=self.permutation,
        )
        return module


class TensorParallel(ParallelStyle):
    """On an `MoE`, ep == 1: every rank holds all experts' hidden shard; the experts' output is partial."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_experts(module.experts, device_mesh, {"w1": [Shard(1)], "w2": [Shard(2)], "w3": [Shard(1)]})
        module.dispatcher = TensorParallelTokenDispatcher(module.num_experts, module.score_before_experts, device_mesh)
        return module


def distribute_experts(experts: nn.Module, mesh: DeviceMesh, placements: dict[str, list]) -> None:
    """Replace the routed experts' w1/w2/w3 by DTensors with `placements` over `mesh` (every EP style uses it). Other
    (E, ...) parameters (LoRA's adapters) go with their experts: sharded on dim 0, where the weights are only so."""
    whole_experts = all(placement == [Shard(0)] for placement in placements.values())
    for name, param in experts.named_parameters(recurse=False):
        placement = placements.get(name)
        if placement is None and not whole_experts:
            raise ValueError(
                f"routed experts' {name}: only expert parallelism without tensor parallelism shards it (with its "
                "experts); drop expert_tensor_parallel_degree / tensor_parallel_degree"
            )
        distributed = distribute_tensor(param, mesh, placement or [Shard(0)])
        experts.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))
