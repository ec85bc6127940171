"""Apply parallelisms to a DeepSeek-V3 model (or one pipeline stage of it), in this order (what is not specific to
DeepSeek-V3's attention and dense layers, steps 2 and 5, is `models/moe/parallelize.py`):

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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import MoERegions, apply_compile
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.expert_parallel.dispatcher import EAGER_PERMUTATION
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import NoParallel, SyncGradColumns
from torchtitan.distributed.utils import device_type, transformer_blocks
from torchtitan.kernels.float8 import check_float8_supported
from torchtitan.models.deepseek_v3.float8_linears import convert_to_float8_linears
from torchtitan.models.moe.exchange import ExchangeBackend, ExchangeContext
from torchtitan.models.moe.experts import convert_to_float8_experts, run_routed_experts
from torchtitan.models.moe.parallelize import (
    apply_fsdp,
    apply_moe_parallel,
    experts_outside_fsdp,
    say_experts_stay_bf16,
)
from torchtitan.models.parallelized import ParallelizedModel
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = ["parallelize_deepseekv3"]


def parallelize_deepseekv3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig, exchange: ExchangeBackend
) -> ParallelizedModel:
    """Apply TP/SP -> EP/ETP (the MoE layers' tokens through `exchange`) -> AC -> compile -> FSDP2 in place; returns
    the model with what was chosen on the way. The config was validated by `preflight.check_job` (every rank runs it
    before building the model), which resolved `exchange`."""
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
        apply_tp(model, parallel_dims.get_mesh("tp"), parallel_dims.loss_parallel_enabled)
    apply_moe_parallel(model, parallel_dims, exchange, ExchangeContext(permutation, device_type() == "cuda"))
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
        attention.register_forward_pre_hook(partial(_full_sequence_freqs_cis, model))


def _full_sequence_freqs_cis(model: nn.Module, module: nn.Module, args: tuple) -> tuple:
    x, freqs_cis, *rest = args
    if freqs_cis.shape[0] == x.shape[1]:
        return args
    return (x, model.freqs_cis[: x.shape[1]], *rest)
