"""`DeepEPExpertParallel`: expert parallelism over DeepEP, as a ParallelStyle on an MoE layer (`DeepEPMoE`).

It shards the routed experts' weights on dim 0 over the 1-D EP mesh (each rank owns E / ep experts), creates the
group's communication buffer (here, at parallelize time, never in forward), and installs a
`DeepEPTokenDispatcher` as the layer's `dispatcher`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.deepep.buffer import get_or_create_buffer, import_deep_ep
from torchtitan.distributed.deepep.dispatcher import DeepEPTokenDispatcher

__all__ = ["DeepEPExpertParallel", "validate_deepep_config"]

DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
"""EP sizes DeepEP v1 has dispatch/combine configs for (`deep_ep.Buffer.get_dispatch_config`); others assert."""


class DeepEPExpertParallel(ParallelStyle):
    """Shard an MoE layer's routed experts on dim 0 over the EP mesh and exchange its tokens with DeepEP.

    num_sms: SMs DeepEP's kernels may use (`parallelism.deepep_num_sms`, even).
    """

    def __init__(self, *, num_sms: int = 24):
        super().__init__()
        self.num_sms = num_sms

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"DeepEPExpertParallel needs the 1-D ep mesh, got a {device_mesh.ndim}-D mesh.")
        experts = module.experts
        num_experts, _, dim = experts.w1.shape  # (E, hidden, dim)
        if num_experts % device_mesh.size() != 0:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {device_mesh.size()} EP ranks.")
        group = device_mesh.get_group()
        get_or_create_buffer(group, dim, device_type=device_mesh.device_type, num_sms=self.num_sms)
        for name, param in experts.named_parameters(recurse=False):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))
        module.dispatcher = DeepEPTokenDispatcher(group.group_name, num_experts, module.score_before_experts)
        return module


def validate_deepep_config(parallel_dims, device_type: str = "cuda") -> None:
    """Raise if `expert_parallel_comm_backend='deepep'` cannot run with these degrees / this install.

    Call before building the model. TP (and so ETP) is rejected: DeepEP dispatch expects every rank to send its own
    tokens, and sequence-sharding the MoE input over TP ranks before dispatch is not implemented.
    """
    if parallel_dims.tp > 1 or parallel_dims.etp > 1:
        raise ValueError(
            f"expert_parallel_comm_backend='deepep' does not support tensor_parallel_degree={parallel_dims.tp} / "
            f"expert_tensor_parallel_degree={parallel_dims.etp}; set both to 1 (use FSDP + EP), or use "
            "--parallelism.expert_parallel_comm_backend standard."
        )
    if parallel_dims.ep > 1 and parallel_dims.ep not in DEEPEP_EP_SIZES:
        raise ValueError(
            f"expert_parallel_degree={parallel_dims.ep}: DeepEP has kernel configs only for EP sizes "
            f"{', '.join(map(str, DEEPEP_EP_SIZES))}; pick one of them, or use "
            "--parallelism.expert_parallel_comm_backend standard."
        )
    if device_type == "cuda" and parallel_dims.ep > 1:
        import_deep_ep()
