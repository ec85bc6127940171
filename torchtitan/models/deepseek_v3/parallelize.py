"""Apply parallelisms to a DeepSeek-V3 model (or one pipeline stage of it), in this order:

0. CP: the model takes a part of each sequence; every attention layer all-gathers its latent over the CP ranks
1. TP / SP on the dense parts (MLA projections, dense FFN, norms, embedding, output head)
2. EP / ETP / TP on the MoE layers (ParallelStyles that shard `moe.experts` and install `moe.dispatcher`; layouts
   at the MoE boundary)
3. activation checkpointing
4. torch.compile per block
5. FSDP2 / HSDP over dp_shard x cp (routed experts in their own unit on the expert-FSDP mesh)

Gradient reduction sums over data-parallel ranks (FSDP's division is turned off): the trainer's loss is already
divided by the global number of valid tokens, so the sum of the ranks' gradients is the gradient of the global loss.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.optimizer import updates_master_weights
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import MoERegions, apply_compile
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION, LocalTokenDispatcher
from torchtitan.distributed.expert_parallel.styles import ExpertTensorParallel, TensorParallel
from torchtitan.distributed.fsdp_gradients import ComputePoolReduceScatter
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import NoParallel, ReplicateOverTokenShards, SyncGradColumns
from torchtitan.distributed.utils import device_type, transformer_blocks
from torchtitan.kernels.float8 import check_float8_supported
from torchtitan.models.deepseek_v3.float8_linears import convert_to_float8_linears
from torchtitan.models.moe.exchange import ExchangeBackend, ExchangeContext, get_backend
from torchtitan.models.moe.experts import GroupedExperts, convert_to_float8_experts, run_routed_experts
from torchtitan.models.moe.overlap import MicroBatchOverlap
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = ["apply_fsdp", "apply_moe_parallel", "apply_tp", "expert_bias_reduce_group", "parallelize_deepseekv3"]


def parallelize_deepseekv3(model: nn.Module, parallel_dims: ParallelDims, job_config: Any) -> nn.Module:
    """Apply TP/SP -> EP/ETP -> AC -> compile -> FSDP2 in place; returns the model. The config was validated by
    `preflight.check_job` (every rank runs it before building the model)."""
    parallelism = job_config.parallelism
    backend = get_backend(parallelism.expert_parallel_comm_backend)
    experts_outside = experts_outside_fsdp(parallel_dims, job_config)
    _say_experts_stay_bf16(model, job_config.training.mixed_precision_param)
    compile_config = job_config.compile
    compiled = compile_config.enable and "model" in compile_config.components
    # Created once for this model: the compiled regions its MoE layers share (the dispatchers are built with them)
    # and, on CUDA, the streams of the shared-expert and micro-batch overlaps.
    regions = MoERegions.build(compile_config.backend, run_routed_experts) if compiled else None
    permutation = regions.permutation if regions is not None else EAGER_PERMUTATION
    on_cuda = device_type() == "cuda"

    if parallel_dims.cp_enabled:
        model.context_parallel = ContextParallel(parallel_dims.get_mesh("cp"))
        for block in transformer_blocks(model):
            block.attention.context_parallel = model.context_parallel
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), parallel_dims.loss_parallel_enabled)
    apply_moe_parallel(model, parallel_dims, backend, ExchangeContext(job_config, permutation, on_cuda))
    if parallelism.expert_parallel_overlap:
        overlap = MicroBatchOverlap(torch.cuda.Stream() if on_cuda else None)
        for block in transformer_blocks(model):
            if block.moe_enabled:
                block.moe.overlap = overlap
    if job_config.quantize.float8_experts:
        check_float8_supported(torch.device(device_type()))
        # FSDP gathers the weights anew every forward: quantized at every use there, else once per optimizer step
        cached = not parallel_dims.fsdp_enabled or experts_outside
        converted = convert_to_float8_experts(model, cache_weights=cached)
        logger.info(
            f"quantize.float8_experts: {converted} routed-expert modules run FP8 grouped GEMMs, their weights "
            + ("quantized once per optimizer step" if cached else "quantized at every use (FSDP)")
        )
    if job_config.quantize.float8_linears:
        check_float8_supported(torch.device(device_type()), "--quantize.float8_linears")
        converted = convert_to_float8_linears(model)
        logger.info(f"quantize.float8_linears: {converted} linears run FP8 GEMMs")

    exchange_ops = backend.sac_save_ops() if parallel_dims.ep_enabled else set()
    apply_ac(model, job_config.activation_checkpoint, regions.all() if regions is not None else (), exchange_ops)
    if regions is not None:
        apply_compile(model, compile_config.backend, regions)

    if parallel_dims.fsdp_enabled:
        dense_mesh = (
            parallel_dims.get_mesh(["dp_replicate", "dp_shard_cp"])
            if parallel_dims.dp_replicate_enabled
            else parallel_dims.get_mesh("dp_shard_cp")
        )
        experts_mesh = (
            parallel_dims.get_mesh(["dp_replicate", "dp_shard_mod_ep"])
            if parallel_dims.dp_replicate_enabled
            else parallel_dims.get_mesh("dp_shard_mod_ep")
        )
        apply_fsdp(
            model,
            dense_mesh,
            experts_mesh if parallel_dims.ep_enabled else None,
            param_dtype=DTYPES[job_config.training.mixed_precision_param],
            reduce_dtype=DTYPES[job_config.training.mixed_precision_reduce],
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            ep_degree=parallel_dims.ep,
            experts_outside=experts_outside,
            blocks_per_unit=parallelism.fsdp_blocks_per_unit,
        )
    return model


def experts_outside_fsdp(parallel_dims: ParallelDims, job_config: Any) -> bool:
    """Whether FSDP leaves the routed experts alone: every expert lives on one rank (the experts' FSDP mesh has one
    rank, e.g. EP = the data-parallel degree), so there is nothing to shard, gather or reduce. Wrapped anyway, FSDP
    copies their weights in each forward and their gradients through a one-rank reduce-scatter in each backward
    (16B_bench4 at FSDP2 x EP2: 2.7 ms of host time and ~2 ms of device copies per MoE layer). Unwrapped, they
    compute in the dtype they are stored in: fp32, or for bf16 compute bf16 weights whose fp32 masters the optimizer
    updates (`components/master_weights.py`; the trainer stores them so), which needs AdamW 'triton'."""
    if not parallel_dims.ep_enabled or parallel_dims.dp_replicate * parallel_dims.dp_shard_mod_ep != 1:
        return False
    if job_config.training.enable_cpu_offload:
        return False
    param_dtype = job_config.training.mixed_precision_param
    return param_dtype == "float32" or (param_dtype == "bfloat16" and updates_master_weights(job_config.optimizer))


def _say_experts_stay_bf16(model: nn.Module, param_dtype: str) -> None:
    """torch._grouped_mm (and its compile path) takes bf16 only: with other parameter dtypes the routed experts
    still compute in bf16. Say so once instead of changing precision silently (an info line: it is how the model
    runs, e.g. the debug config's fp32 on a CPU, not a mistake in the job)."""
    uses_grouped_mm = any(isinstance(m, GroupedExperts) and m.use_grouped_mm for m in model.modules())
    if param_dtype == "bfloat16" or not uses_grouped_mm:
        return
    logger.info(
        f"training.mixed_precision_param={param_dtype}: the routed experts' grouped GEMMs still run in bfloat16 "
        "(the only dtype torch._grouped_mm takes); the rest of the model uses the parameter dtype"
    )


def expert_bias_reduce_group(parallel_dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group over which MoE token counts are summed before the expert-bias update.

    Counts differ between batch ranks (dp) and context-parallel ranks (cp: other tokens of the same sequences). TP
    ranks route identical (all-gathered) tokens, so they are not reduced over tp, except when EP borrows the tp ranks
    (etp == 1): then each tp rank routes its own sequence shard. Pipeline stages hold different layers, so pp is
    never part of the group. None: nothing to reduce.
    """
    if parallel_dims.moe_tokens_sequence_sharded:
        return parallel_dims.get_mesh("dp_tp").get_group()
    mesh = parallel_dims.get_optional_mesh("dp_cp")
    return mesh.get_group() if mesh is not None else None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Tensor + sequence parallelism on everything except the MoE layers' insides.

    Between blocks the hidden states are local sequence shards (Shard(1)); attention and the dense FFN all-gather
    them, run column-/row-wise sharded projections (heads / hidden units split over tp) and reduce-scatter back.
    """
    top_plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        top_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)

    for block in model.layers.values():
        attention = block.attention
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            # forward(x, freqs_cis, attention_mask): gather the sequence, keep the other inputs as they are
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            # wkv_a's output is [c_kv | k_pe]; k_pe is shared by all heads, so its gradient is a partial sum
            # over the tp ranks' heads and must be all-reduced (c_kv's is, by wkv_b's ColwiseParallel).
            "attention.wkv_a": SyncGradColumns(start=attention.kv_lora_rank),
            "attention.kv_norm": NoParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if attention.q_lora_rank == 0:
            plan["attention.wq"] = ColwiseParallel()
        else:
            plan.update(
                {"attention.wq_a": NoParallel(), "attention.q_norm": NoParallel(), "attention.wq_b": ColwiseParallel()}
            )
        if not block.moe_enabled:
            plan.update(
                {
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                    ),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
        # The model slices freqs_cis to the length of its (sequence-sharded) hidden states; attention runs on the
        # all-gathered sequence and needs the rotary table for all positions. Registered after PrepareModuleInput's
        # hook, so x is already gathered here. Slicing the model's buffer is a no-op when freqs_cis already fits.
        attention.register_forward_pre_hook(partial(_full_sequence_freqs_cis, model))


def _full_sequence_freqs_cis(model: nn.Module, module: nn.Module, args: tuple) -> tuple:
    x, freqs_cis, *rest = args
    if freqs_cis.shape[0] == x.shape[1]:
        return args
    return (x, model.freqs_cis[: x.shape[1]], *rest)


def apply_moe_parallel(
    model: nn.Module,
    parallel_dims: ParallelDims,
    backend: ExchangeBackend,
    exchange: ExchangeContext,
) -> None:
    """Layouts at the MoE boundary plus the experts' ParallelStyle.

    | case                  | MoE input (from SP)  | router, shared experts          | routed experts              |
    | tp, ep == 1           | all-gather: Replicate | gate replicated, shared TP     | TensorParallel (tp)         |
    | tp == etp, ep > 1     | all-gather: Replicate | gate replicated, shared TP     | ExpertTensorParallel (ep,etp)|
    | tp > 1, etp == 1, ep  | local sequence shard  | replicated weights, own tokens | the backend's style (ep)    |
    | tp == 1, ep > 1       | plain tensor          | plain                          | the backend's style (ep)    |
    With a Replicate input the MoE output is a partial sum over tp, reduce-scattered to the sequence shard.
    The all-to-all dispatchers are built with `exchange.permutation`; under EP without ETP the exchange `backend` gives
    each layer its style and, maybe, a subclass (`models/moe/exchange.py`). Without TP or EP the layers keep a local
    dispatcher.
    """
    style = backend.style(exchange) if parallel_dims.ep_enabled and not parallel_dims.etp_enabled else None
    tp_mesh = parallel_dims.get_optional_mesh("tp")
    for block in transformer_blocks(model):
        if not block.moe_enabled:
            continue
        moe = block.moe
        if tp_mesh is not None and parallel_dims.moe_tokens_sequence_sharded:
            plan: dict[str, Any] = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Shard(1),),
                    use_local_input=True,
                    output_layouts=(Shard(1),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                ),
                "moe.router.gate": ReplicateOverTokenShards(),
            }
            if moe.shared_experts is not None:
                plan["moe.shared_experts"] = ReplicateOverTokenShards()
            parallelize_module(block, tp_mesh, plan)
        elif tp_mesh is not None:
            plan = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Partial(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                ),
                "moe.router.gate": NoParallel(),
            }
            if moe.shared_experts is not None:
                plan.update(
                    {
                        "moe.shared_experts.w1": ColwiseParallel(),
                        "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                        "moe.shared_experts.w3": ColwiseParallel(),
                    }
                )
            parallelize_module(block, tp_mesh, plan)

        # the experts' sharding and the token dispatcher that feeds them
        if parallel_dims.etp_enabled:
            parallelize_module(moe, parallel_dims.get_mesh(["ep", "etp"]), ExpertTensorParallel(exchange.permutation))
        elif style is not None:
            block.moe = moe = backend.layer(moe, exchange)
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
    MTP module its own), [norm, output], the root.

    With EP (`experts_mesh` set), each MoE block's routed experts form their own unit on the expert-FSDP mesh (the
    dp ranks EP did not take); the router and shared experts stay in the block's unit. `experts_outside`
    (`experts_outside_fsdp`): the experts' parameters are left out of every unit instead.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if experts_outside:
        moe_blocks = [_inner(block) for block in transformer_blocks(model) if _inner(block).moe_enabled]
        config["ignored_params"] = {param for block in moe_blocks for param in block.moe.experts.parameters()}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    match reshard_after_forward_policy:
        case "always":
            reshard_after_forward = True
        case "never":
            reshard_after_forward = False
        case "default":
            # With PP, resharding would all-gather again for every micro-batch. With EP, each backward all-gather
            # is one more collective between the EP ranks (which already meet at every DeepEP barrier), and on an
            # expert mesh of one rank a gather is a copy of the experts' weights: keeping every unit's gathered
            # weights until its backward trades memory (the bf16 copies of all layers) for time (benchmarks/NOTES.md).
            reshard_after_forward = not pp_enabled and experts_mesh is None
        case _:
            raise ValueError(
                f"parallelism.fsdp_reshard_after_forward={reshard_after_forward_policy!r}: use default, always, never"
            )

    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard_after_forward)
    blocks = list(model.layers.values())
    one_rank_units = []  # units whose mesh has one rank: nothing to reduce
    for block in transformer_blocks(model):  # MTP modules: units like blocks, outside the explicit prefetch
        if experts_mesh is not None and not experts_outside and _inner(block).moe_enabled:
            experts = _inner(block).moe.experts
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
    block_units += [[block] for block in transformer_blocks(model)[len(blocks) :]]  # the MTP modules
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
            # divides by nothing already, and a factor there only makes it copy the gradients through a temporary
            # (1 GiB per MoE layer on 16B_bench4 at EP = FSDP degree).
            if dp_mesh.size() > 1 and not any(module is unit for unit in one_rank_units):
                module.set_gradient_divide_factor(1.0)

    if experts_mesh is not None:
        _set_explicit_prefetch(model, [unit for unit in block_units if unit[0] in blocks])


def _set_explicit_prefetch(model: nn.Module, block_units: list[list[nn.Module]]) -> None:
    """EP's dispatch copies split sizes to the host, which stalls the CPU thread that would issue FSDP's implicit
    next-unit all-gather; name the next units (a unit of blocks, by its first block, and its blocks' experts units)
    explicitly instead. A unit's hooks run on its first block in forward and its last in backward."""

    def units(blocks: list[nn.Module]) -> list[nn.Module]:
        experts = [_inner(b).moe.experts for b in blocks if _inner(b).moe_enabled]
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


def _inner(block: nn.Module) -> nn.Module:
    """The transformer block behind an activation-checkpoint wrapper."""
    return getattr(block, "_checkpoint_wrapped_module", block)
