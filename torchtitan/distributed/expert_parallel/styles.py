"""ParallelStyles for an `MoE` layer's routed experts: each shards `moe.experts` and installs the layer's token
dispatcher; the experts module never changes and no hooks rewrite its arguments.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.deepep.buffer import get_or_create_buffer
from torchtitan.distributed.expert_parallel.all_to_all import AllToAllTokenDispatcher, TensorParallelTokenDispatcher
from torchtitan.distributed.expert_parallel.deepep_dispatcher import DeepEPTokenDispatcher
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION, TokenPermutation
from torchtitan.distributed.expert_parallel.symm_mem_dispatcher import SymmMemTokenDispatcher, receive_rows
from torchtitan.distributed.symm_mem_all_to_all import get_or_create_buffers

__all__ = ["DeepEPExpertParallel", "ExpertParallel", "ExpertTensorParallel", "SymmMemExpertParallel", "TensorParallel"]

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


class SymmMemExpertParallel(_ExpertStyle):
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
        super().__init__(permutation)
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
            get_or_create_buffers(
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


def distribute_experts(experts: nn.Module, mesh: DeviceMesh, placements: dict[str, list]) -> None:
    """Replace the routed experts' w1/w2/w3 by DTensors with `placements` over `mesh` (every EP style uses it)."""
    for name, param in experts.named_parameters(recurse=False):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))
