"""Parallelisms of an MoE transformer independent of its attention and dense layers: the MoE layers' expert
parallelism (EP / ETP / TP on the experts, the exchange backend's dispatcher, the layouts at the MoE boundary) and
FSDP2 over the blocks. A model's own parallelize (e.g. `models/deepseek_v3/parallelize.py`) applies its tensor-parallel
plan, then these. The model has `layers` (a dict of blocks with `moe_enabled`, and `moe` for MoE blocks), optionally
`mtp`, `tok_embeddings`, `norm` and `output` (None where a pipeline stage does not hold them).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from torchtitan.components.optimizer import updates_master_weights
from torchtitan.config import JobConfig
from torchtitan.distributed.expert_parallel.dispatcher import LocalTokenDispatcher
from torchtitan.distributed.expert_parallel.styles import ExpertTensorParallel, TensorParallel
from torchtitan.distributed.fsdp_gradients import ComputePoolReduceScatter
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import NoParallel, ReplicateOverTokenShards
from torchtitan.distributed.utils import transformer_blocks, unwrapped_block
from torchtitan.models.moe.exchange import ExchangeBackend, ExchangeContext
from torchtitan.models.moe.experts import GroupedExperts

logger = logging.getLogger(__name__)

__all__ = [
    "apply_fsdp",
    "apply_moe_parallel",
    "expert_bias_reduce_group",
    "experts_outside_fsdp",
    "say_experts_stay_bf16",
]


def experts_outside_fsdp(parallel_dims: ParallelDims, job_config: JobConfig) -> bool:
    """Whether FSDP leaves the routed experts alone: every expert lives on one rank (the experts' FSDP mesh has one
    rank, e.g. EP = the data-parallel degree), so there is nothing to shard, gather or reduce, and wrapping them would
    only copy their weights in each forward and their gradients in each backward. Unwrapped, they compute in the
    dtype they are stored in: fp32, or for bf16 compute bf16 weights whose fp32 masters the optimizer updates
    (`components/master_weights.py`; the trainer stores them so), which needs optimizers that update such masters
    (`updates_master_weights`: AdamW or Muon with implementation 'triton')."""
    one_rank_experts = parallel_dims.ep_enabled and parallel_dims.dp_replicate * parallel_dims.dp_shard_mod_ep == 1
    if not one_rank_experts or job_config.training.enable_cpu_offload:
        return False
    param_dtype = job_config.training.mixed_precision_param
    return param_dtype == "float32" or (param_dtype == "bfloat16" and updates_master_weights(job_config.optimizer))


def say_experts_stay_bf16(model: nn.Module, param_dtype: str) -> None:
    """torch._grouped_mm takes bf16 only, so with other parameter dtypes the routed experts still compute in bf16:
    say so once (info: it is how the model runs, e.g. the debug config's fp32 on a CPU, not a mistake in the job)."""
    uses_grouped_mm = any(isinstance(m, GroupedExperts) and m.use_grouped_mm for m in model.modules())
    if param_dtype == "bfloat16" or not uses_grouped_mm:
        return
    logger.info(
        f"training.mixed_precision_param={param_dtype}: the routed experts' grouped GEMMs still run in bfloat16 "
        "(the only dtype torch._grouped_mm takes); the rest of the model uses the parameter dtype"
    )


def expert_bias_reduce_group(parallel_dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group over which MoE token counts are summed before the expert-bias update; None: nothing to reduce. Counts
    differ between batch ranks (dp) and context-parallel ranks (cp: other tokens of the same sequences). TP ranks
    route identical (all-gathered) tokens, except when EP borrows the tp ranks (etp == 1): then each routes its own
    sequence shard. Pipeline stages hold different layers, so pp is never in the group."""
    if parallel_dims.moe_tokens_sequence_sharded:
        return parallel_dims.get_mesh("dp_tp").get_group()
    mesh = parallel_dims.get_optional_mesh("dp_cp")
    return mesh.get_group() if mesh is not None else None


def apply_moe_parallel(
    model: nn.Module, parallel_dims: ParallelDims, exchange: ExchangeBackend, context: ExchangeContext
) -> None:
    """Layouts at the MoE boundary plus the experts' ParallelStyle.

    | case                  | MoE input (from SP)  | router, shared experts          | routed experts              |
    | tp, ep == 1           | all-gather: Replicate | gate replicated, shared TP     | TensorParallel (tp)         |
    | tp == etp, ep > 1     | all-gather: Replicate | gate replicated, shared TP     | ExpertTensorParallel (ep,etp)|
    | tp > 1, etp == 1, ep  | local sequence shard  | replicated weights, own tokens | the backend's style (ep)    |
    | tp == 1, ep > 1       | plain tensor          | plain                          | the backend's style (ep)    |
    With a Replicate input the MoE output is a partial sum over tp, reduce-scattered to the sequence shard. The
    all-to-all dispatchers are built with `context.permutation`; the backend may give each layer a subclass.
    """
    style = exchange.style(context) if parallel_dims.ep_enabled and not parallel_dims.etp_enabled else None
    tp_mesh = parallel_dims.get_optional_mesh("tp")
    for block in transformer_blocks(model):
        if not block.moe_enabled:
            continue
        moe = block.moe
        if tp_mesh is not None:
            # each tp rank routes its own sequence shard, or all of them (all-gathered; a partial sum out)
            sequence_sharded = parallel_dims.moe_tokens_sequence_sharded
            plan: dict[str, Any] = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Shard(1),) if sequence_sharded else (Replicate(),),
                    use_local_input=True,
                    output_layouts=(Shard(1),) if sequence_sharded else (Partial(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                ),
                "moe.router.gate": ReplicateOverTokenShards() if sequence_sharded else NoParallel(),
            }
            if moe.shared_experts is not None and sequence_sharded:
                plan["moe.shared_experts"] = ReplicateOverTokenShards()
            elif moe.shared_experts is not None:
                plan["moe.shared_experts.w1"] = ColwiseParallel()
                plan["moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Partial())
                plan["moe.shared_experts.w3"] = ColwiseParallel()
            parallelize_module(block, tp_mesh, plan)

        # the experts' sharding and the token dispatcher that feeds them (without TP or EP: a local one)
        if parallel_dims.etp_enabled:
            parallelize_module(moe, parallel_dims.get_mesh(["ep", "etp"]), ExpertTensorParallel(context.permutation))
        elif style is not None:
            block.moe = moe = exchange.layer(moe, context)
            parallelize_module(moe, parallel_dims.get_mesh("ep"), style)
        elif tp_mesh is not None:
            parallelize_module(moe, tp_mesh, TensorParallel())
        else:
            moe.dispatcher = LocalTokenDispatcher(moe.num_experts, moe.score_before_experts)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    experts_mesh: DeviceMesh | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward_policy: str = "default",
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    ep_degree: int = 1,
    experts_outside: bool = False,
    blocks_per_unit: int = 1,
) -> None:
    """FSDP2 (HSDP when dp_mesh is 2-D): embedding, the blocks in units of `blocks_per_unit` consecutive blocks (each
    MTP module its own), [norm, output], the root. With EP (`experts_mesh` set), each MoE block's routed experts form
    their own unit on the expert-FSDP mesh (the dp ranks EP did not take); the router and shared experts stay in the
    block's unit. `experts_outside` (`experts_outside_fsdp`): the experts' parameters are left out of every unit."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    moe_blocks = [unwrapped_block(b) for b in transformer_blocks(model) if unwrapped_block(b).moe_enabled]  # MTP too
    if experts_outside:
        config["ignored_params"] = {param for block in moe_blocks for param in block.moe.experts.parameters()}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    match reshard_after_forward_policy:
        case "always":
            reshard_after_forward = True
        case "never":
            reshard_after_forward = False
        case "default":
            # With PP, resharding would all-gather again for every micro-batch; with EP, each backward all-gather is
            # one more collective between the EP ranks (on a one-rank expert mesh, a copy of the experts' weights).
            # Keeping the gathered weights until backward trades memory for time (benchmarks/NOTES.md).
            reshard_after_forward = not pp_enabled and experts_mesh is None
        case _:
            raise ValueError(
                f"parallelism.fsdp_reshard_after_forward={reshard_after_forward_policy!r}: use default, always, never"
            )

    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard_after_forward)
    blocks = list(model.layers.values())
    one_rank_units = []  # units whose mesh has one rank: nothing to reduce
    if experts_mesh is not None and not experts_outside:
        for experts in (block.moe.experts for block in moe_blocks):
            if experts_mesh.size() == 1:
                one_rank_units.append(experts)
            # EP already split dim 0 (experts); when the FSDP ranks outnumber the local experts, shard dim 1 instead
            # so no rank gets an empty shard.
            local_experts = experts.num_experts // ep_degree
            placement_fn = (lambda param: Shard(1)) if experts_mesh.size() > local_experts else None
            fully_shard(
                experts,
                **{**config, "mesh": experts_mesh},
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=placement_fn,
            )
    block_units = [blocks[i : i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]
    block_units += [[block] for block in transformer_blocks(model)[len(blocks) :]]  # the MTP modules, outside prefetch
    for unit in block_units:
        fully_shard(unit if len(unit) > 1 else unit[0], **config, reshard_after_forward=reshard_after_forward)
    if model.norm is not None and model.output is not None:
        # the head runs last in forward and first in backward: keeping it unsharded saves an all-gather
        keep_unsharded = reshard_after_forward_policy != "always"
        fully_shard([model.norm, model.output], **config, reshard_after_forward=not keep_unsharded)
    fully_shard(model, **config)

    reduce_scatter = ComputePoolReduceScatter()  # gradients from the compute stream's pool (fsdp_gradients.py)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(reduce_scatter)
            module.set_force_sum_reduction_for_comms(True)
            # plain SUM (gloo has no PREMUL_SUM; a factor of 1 makes the post-division a no-op). On one rank FSDP
            # divides by nothing already, and a factor there only copies the gradients through a temporary.
            if dp_mesh.size() > 1 and not any(module is unit for unit in one_rank_units):
                module.set_gradient_divide_factor(1.0)

    if experts_mesh is not None:
        _set_explicit_prefetch(model, [unit for unit in block_units if unit[0] in blocks])


def _set_explicit_prefetch(model: nn.Module, block_units: list[list[nn.Module]]) -> None:
    """EP's dispatch copies split sizes to the host, which stalls the CPU thread that would issue FSDP's implicit
    next-unit all-gather; name the next units (a unit of blocks, by its first block, and its blocks' experts units)
    explicitly instead. A unit's hooks run on its first block in forward and its last in backward."""

    def units(blocks: list[nn.Module]) -> list[nn.Module]:
        experts = [unwrapped_block(b).moe.experts for b in blocks if unwrapped_block(b).moe_enabled]
        return [blocks[0], *(e for e in experts if isinstance(e, FSDPModule))]

    if not block_units:
        return
    first, last = block_units[0], block_units[-1]
    if model.tok_embeddings is not None:
        model.tok_embeddings.set_modules_to_forward_prefetch(units(first))
    for unit, next_unit in zip(block_units, block_units[1:], strict=False):
        unit[0].set_modules_to_forward_prefetch(units(next_unit))
    if model.norm is not None and model.output is not None:
        last[0].set_modules_to_forward_prefetch([model.norm])
        model.norm.set_modules_to_backward_prefetch(units(last))
    reversed_units = block_units[::-1]
    for unit, prev_unit in zip(reversed_units, reversed_units[1:], strict=False):
        unit[0].set_modules_to_backward_prefetch(units(prev_unit))
    if model.tok_embeddings is not None:
        first[0].set_modules_to_backward_prefetch([model.tok_embeddings])
