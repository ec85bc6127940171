"""`DeepEPExpertParallel`: expert parallelism over DeepEP, as a ParallelStyle on an MoE layer (`DeepEPMoE`).

It shards the routed experts' weights on dim 0 over the 1-D EP mesh (each rank owns E / ep experts), creates the
group's communication buffer (here, at parallelize time, never in forward), and installs a
`DeepEPTokenDispatcher` as the layer's `dispatcher`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.deepep.buffer import get_or_create_buffer, import_deep_ep
from torchtitan.distributed.deepep.dispatcher import DeepEPTokenDispatcher
from torchtitan.distributed.expert_parallel import EXPERTS_ON_EP_RANKS, check_experts_divisible, distribute_experts

__all__ = ["DeepEPExpertParallel", "validate_deepep_config"]

DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
"""EP sizes DeepEP v1 has dispatch/combine configs for (`deep_ep.Buffer.get_dispatch_config`); others assert."""


class DeepEPExpertParallel(ParallelStyle):
    """Shard an MoE layer's routed experts on dim 0 over the EP mesh and exchange its tokens with DeepEP.

    num_sms: SMs DeepEP's kernels may use (`parallelism.deepep_num_sms`, even).
    sync_free: dispatch with worst-case receive sizes, no host wait (`parallelism.deepep_sync_free_dispatch`).
    fp8: dispatch tokens as FP8 with one scale per 128 channels (`quantize.float8_dispatch`).
    """

    def __init__(self, *, num_sms: int = 24, sync_free: bool = False, fp8: bool = False):
        super().__init__()
        self.num_sms = num_sms
        self.sync_free = sync_free
        self.fp8 = fp8

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"DeepEPExpertParallel needs the 1-D ep mesh, got a {device_mesh.ndim}-D mesh.")
        check_experts_divisible(module, device_mesh.size())
        group = device_mesh.get_group()
        dim = module.experts.w1.shape[2]  # (E, hidden, dim)
        buffer = get_or_create_buffer(group, dim, device_type=device_mesh.device_type, num_sms=self.num_sms)
        if self.sync_free and buffer.layout.name == "internode":
            raise ValueError(
                "parallelism.deepep_sync_free_dispatch: DeepEP's worst-case receive sizes are intranode only and this "
                "EP group spans nodes; drop --parallelism.deepep_sync_free_dispatch"
            )
        distribute_experts(module.experts, device_mesh, EXPERTS_ON_EP_RANKS)
        module.dispatcher = DeepEPTokenDispatcher(
            group.group_name, module.num_experts, module.score_before_experts, sync_free=self.sync_free, fp8=self.fp8
        )
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
