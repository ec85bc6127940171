"""Apply parallelisms to an MoE transformer (or one pipeline stage of it): `parallelize_moe_model`, the order every
model here follows, and the parts of it that do not depend on the model's attention. A model's own parallelize
(`models/<model>/parallelize.py`) is that order with its attention's tensor-parallel plan:

0. CP: the model takes a part of each sequence; every attention layer gathers what it needs over the CP ranks
1. TP / SP on the dense parts (`apply_tp`: embedding, norms, dense FFN, output head, and the model's attention plan)
2. EP / ETP / TP on the MoE layers (`apply_moe_parallel`: ParallelStyles that shard `moe.experts` and install
   `moe.dispatcher`; layouts at the MoE boundary)
3. FP8 routed experts and dense linears, where asked
4. activation checkpointing
5. torch.compile per block
6. FSDP2 / HSDP over dp_shard x cp (`apply_fsdp`: routed experts in their own unit on the expert-FSDP mesh)

The model has `layers` (a dict of blocks with `moe_enabled`, `attention`, and `moe` for MoE blocks), optionally `mtp`,
`tok_embeddings`, `norm` and `output` (None where a pipeline stage does not hold them), and `context_parallel`.
Gradient reduction sums over data-parallel ranks (FSDP's division is turned off): the trainer's loss is already
divided by the global number of valid tokens, so the sum of the ranks' gradients is the gradient of the global loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.optimizer import updates_master_weights
from torchtitan.config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import MoERegions, apply_compile
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION, LocalTokenDispatcher
from torchtitan.distributed.expert_parallel.styles import ExpertTensorParallel, TensorParallel
from torchtitan.distributed.fsdp_gradients import ComputePoolReduceScatter
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import NoParallel, ReplicateOverTokenShards
from torchtitan.distributed.utils import device_type, transformer_blocks, unwrapped_block
from torchtitan.kernels.float8 import check_float8_supported
from torchtitan.models.moe.exchange import ExchangeBackend, ExchangeContext
from torchtitan.models.moe.experts import GroupedExperts, convert_to_float8_experts, run_routed_experts
from torchtitan.models.moe.float8_linears import convert_to_float8_linears
from torchtitan.models.moe.moe import MoE
from torchtitan.models.parallelized import ParallelizedModel
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionPlan",
    "apply_fsdp",
    "apply_moe_parallel",
    "apply_tp",
    "expert_bias_reduce_group",
    "experts_outside_fsdp",
    "parallelize_moe_model",
    "say_experts_stay_bf16",
]

AttentionPlan = Callable[[nn.Module], dict[str, ParallelStyle]]
"""A block's attention module -> its tensor-parallel plan, keyed by the names inside the attention (`wo`, ...). The
attention gets its input sequence-gathered (Replicate) and returns a Shard(1) output: its output projection is
`RowwiseParallel(output_layouts=Shard(1))`."""


def parallelize_moe_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    exchange: ExchangeBackend,
    attention_plan: AttentionPlan,
) -> ParallelizedModel:
    """Apply CP -> TP/SP (`attention_plan` for each attention) -> EP/ETP (the MoE layers' tokens through `exchange`)
    -> FP8 -> AC -> compile -> FSDP2 in place; returns the model with what was chosen on the way. The config was
    validated by `preflight.check_job` (every rank runs it before building the model), which resolved `exchange`."""
    parallelism = job_config.parallelism
    experts_outside = experts_outside_fsdp(parallel_dims, job_config)
    say_experts_stay_bf16(model, job_config.training.mixed_precision_param)
    compile_config = job_config.compile
    compiled = compile_config.enable and "model" in compile_config.components
    # Created once for this model: the compiled regions its MoE layers share (the dispatchers are built with them)
    # and, on CUDA, the shared experts' side stream (`ExchangeContext`).
    regions = MoERegions.build(compile_config.backend, run_routed_experts) if compiled else None
    permutation = regions.permutation if regions is not None else EAGER_PERMUTATION

    context_parallel = ContextParallel(parallel_dims.get_mesh("cp")) if parallel_dims.cp_enabled else None
    if context_parallel is not None:
        model.context_parallel = context_parallel
        for block in transformer_blocks(model):
            block.attention.context_parallel = context_parallel
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), parallel_dims.loss_parallel_enabled, attention_plan)
    apply_moe_parallel(model, parallel_dims, exchange, ExchangeContext(permutation, device_type() == "cuda"))
    balance_group = expert_bias_reduce_group(parallel_dims)
    for module in model.modules():
        if isinstance(module, MoE):  # the ranks the global-batch balance loss counts tokens over
            module.balance_group = balance_group
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

    exchange_ops = exchange.sac_save_ops() if parallel_dims.ep_enabled else set()
    compiled_regions = regions.all() if regions is not None else ()
    budget_blocks = apply_ac(model, job_config.activation_checkpoint, compiled_regions, exchange_ops)
    if regions is not None:
        apply_compile(model, compile_config.backend, regions)

    if parallel_dims.fsdp_enabled:
        replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []  # HSDP
        apply_fsdp(
            model,
            parallel_dims.get_mesh([*replicate, "dp_shard_cp"]),
            parallel_dims.get_mesh([*replicate, "dp_shard_mod_ep"]) if parallel_dims.ep_enabled else None,
            param_dtype=DTYPES[job_config.training.mixed_precision_param],
            reduce_dtype=DTYPES[job_config.training.mixed_precision_reduce],
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            ep_degree=parallel_dims.ep,
            experts_outside=experts_outside,
            blocks_per_unit=parallelism.fsdp_blocks_per_unit,
        )
    return ParallelizedModel([model], experts_outside, context_parallel, budget_blocks)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, attention_plan: AttentionPlan) -> None:
    """Tensor + sequence parallelism on everything except the MoE layers' insides.

    Between blocks the hidden states are local sequence shards (Shard(1)); attention and the dense FFN all-gather
    them, run column-/row-wise sharded projections (heads / hidden units split over tp) and reduce-scatter back.
    Inside the attention, `attention_plan`'s styles.
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
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            # forward(x, freqs_cis, attention_mask): gather the sequence, keep the other inputs as they are
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "ffn_norm": SequenceParallel(),
        }
        plan |= {f"attention.{name}": style for name, style in attention_plan(block.attention).items()}
        if not block.moe_enabled:
            plan |= {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)
        # The model slices freqs_cis to its sequence-sharded hidden states; attention needs all positions'. This
        # hook runs after PrepareModuleInput's, so x is already gathered; a freqs_cis that fits passes unchanged.
        block.attention.register_forward_pre_hook(partial(_full_sequence_freqs_cis, model))


def _full_sequence_freqs_cis(model: nn.Module, module: nn.Module, args: tuple) -> tuple:
    x, freqs_cis, *rest = args
    if freqs_cis.shape[0] == x.shape[1]:
        return args
    return (x, model.freqs_cis[: x.shape[1]], *rest)


def experts_outside_fsdp(parallel_dims: ParallelDims, job_config: JobConfig) -> bool:
    """Whether FSDP leaves the routed experts alone: every expert lives on one rank (the experts' FSDP mesh has one
    rank, e.g. EP = the data-parallel degree), so there is nothing to shard, gather or reduce, and wrapping them would
    only copy their weights in each forward and their gradients in each backward. Unwrapped, they compute in the
    dtype they are stored in: fp32, or for bf16 compute bf16 weights whose fp32 masters the optimizer updates
    (`components/master_weights.py`; the trainer stores them so), which needs optimizers that update such masters
    (`components/optimizer.py`'s `updates_master_weights`)."""
    one_rank_experts = parallel_dims.ep_enabled and parallel_dims.dp_replicate * parallel_dims.dp_shard_mod_ep == 1
    if not one_rank_experts or job_config.training.enable_cpu_offload:
        return False
    param_dtype = job_config.training.mixed_precision_param
    return param_dtype == "float32" or (param_dtype == "bfloat16" and updates_master_weights(job_config))


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
