"""`DeepEPExpertParallel`: expert parallelism over DeepEP, as a ParallelStyle on `moe.experts`.

`DeepEPMoE` calls `experts(x, top_scores, selected_experts)`. This style turns that call into
`GroupedExperts.forward(expert_input, tokens_per_local_expert)` with two hooks installed by `distribute_module`:

- input hook: `DeepEPTokenDispatcher.dispatch` (dispatch + permutation to local-expert-major rows);
- output hook: `DeepEPTokenDispatcher.combine` -> (num_tokens, dim).

The dispatch state goes from the input hook to the output hook through a per-module FIFO: the input hook appends,
the output hook pops the oldest. A module call runs its two hooks back to back (also when activation checkpointing
recomputes it), so the FIFO holds at most one state between them and is empty after every forward; the state
(and the handle tensors in it) is then owned only by autograd.

Weights are sharded on dim 0 over the 1-D EP mesh (each rank owns E / ep experts); the communication buffer is
created here, at apply time, never in forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.deepep.buffer import get_or_create_buffer, import_deep_ep
from torchtitan.distributed.deepep.dispatcher import DeepEPDispatchState, DeepEPTokenDispatcher

__all__ = ["DEEPEP_HOOKS_ATTR", "DeepEPExpertParallel", "DeepEPExpertsHooks", "validate_deepep_config"]

DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
"""EP sizes DeepEP v1 has dispatch/combine configs for (`deep_ep.Buffer.get_dispatch_config`); others assert."""

DEEPEP_HOOKS_ATTR = "deepep_hooks"
"""Attribute of an experts module that DeepEPExpertParallel was applied to (checked by DeepEPMoE)."""


class DeepEPExpertsHooks:
    """The dispatcher of one experts module and the FIFO of its in-flight dispatch states."""

    def __init__(self, dispatcher: DeepEPTokenDispatcher):
        self.dispatcher = dispatcher
        self.states: list[DeepEPDispatchState] = []

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        x, top_scores, selected_experts = inputs
        expert_input, tokens_per_local_expert, state = self.dispatcher.dispatch(x, selected_experts, top_scores)
        self.states.append(state)
        return expert_input, tokens_per_local_expert

    def combine(self, module: nn.Module, expert_output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return self.dispatcher.combine(expert_output, self.states.pop(0))


class DeepEPExpertParallel(ParallelStyle):
    """Shard `GroupedExperts` weights on dim 0 over the EP mesh and exchange tokens with DeepEP.

    num_sms: SMs DeepEP's kernels may use (`parallelism.deepep_num_sms`, even).
    score_before_experts: apply routing weights to the expert input instead of the output (`MoEArgs`).
    """

    def __init__(self, *, num_sms: int = 24, score_before_experts: bool = False):
        super().__init__()
        self.num_sms = num_sms
        self.score_before_experts = score_before_experts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"DeepEPExpertParallel needs the 1-D ep mesh, got a {device_mesh.ndim}-D mesh.")
        num_experts, _, dim = module.w1.shape  # (E, hidden, dim)
        if num_experts % device_mesh.size() != 0:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {device_mesh.size()} EP ranks.")
        group = device_mesh.get_group()
        get_or_create_buffer(group, dim, device_type=device_mesh.device_type, num_sms=self.num_sms)
        hooks = DeepEPExpertsHooks(DeepEPTokenDispatcher(group.group_name, num_experts, self.score_before_experts))
        setattr(module, DEEPEP_HOOKS_ATTR, hooks)
        return distribute_module(
            module, device_mesh, partition_fn=_shard_experts, input_fn=hooks.dispatch, output_fn=hooks.combine
        )


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in module.named_parameters(recurse=False):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


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
