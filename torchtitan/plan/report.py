"""The plan as text: the model and layout, memory per GPU by category against the card, the step by part, predicted
tokens/s/GPU and MFU, the assumptions with their sources, and the cheapest change when the job does not fit."""

from __future__ import annotations

from torchtitan.components.optimizer import section_groups
from torchtitan.plan.estimate import Plan
from torchtitan.plan.fixes import Change
from torchtitan.plan.hardware import DEEPEP_INTERNODE, DEEPEP_INTRANODE_EP8, GPUS, NON_ALLOCATOR_GIB, NVLINK, RDMA
from torchtitan.plan.layout import ranks_per_token
from torchtitan.plan.memory import ACTIVATION_SCALE, GIB, imbalance, reshards
from torchtitan.plan.newton_schulz import newton_schulz_rate
from torchtitan.plan.rates import GPU_RATES, MUON_STEP, SHAPE_RATES
from torchtitan.plan.speed import (
    BUBBLE,
    NCCL_NVLINK_EFFICIENCY,
    deepep_rates,
    optimizer_bandwidth,
    shape_speedups,
    timed_as,
)

__all__ = ["format_plan"]

ACCURACY = "benchmarks/plan_check.json"


def format_plan(plan: Plan, fits: list[tuple[Change, Plan]] | None = None, accuracy: str = "") -> str:
    lines = _header(plan) + [""] + _memory(plan) + [""] + _time(plan) + [""] + _assumptions(plan)
    if accuracy:
        lines += ["", accuracy]
    if not plan.fits:
        lines += [""] + _fixes(plan, fits or [])
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    job, layout, dims, args = plan.job, plan.layout, plan.layout.dims, plan.layout.args
    gpu = GPUS[plan.gpu]
    total, active, flops, without_mtp, active_without_mtp = plan.counts
    with_mtp = (
        f" ({total / 1e9:.1f}B / {active / 1e9:.1f}B with {args.mtp_layers} MTP module(s))" if args.mtp_layers else ""
    )
    lines = [
        f"plan: {job.job.config_file or 'defaults'} on {plan.nnodes} node(s) x {layout.gpus_per_node} {gpu.name} "
        f"= {dims.world_size} GPUs",
        f"model {job.model.shape_source()}: {without_mtp / 1e9:.1f}B parameters, {active_without_mtp / 1e9:.1f}B "
        f"active per token{with_mtp}; {flops / 1e9:.1f} GFLOP per token trained (the trainer's formula at seq_len "
        f"{job.training.seq_len})",
    ]
    par = job.parallelism
    parts = [f"PP {dims.pp}", f"FSDP {dims.dp_shard * dims.cp}"]
    if dims.dp_replicate > 1:
        parts.insert(1, f"HSDP replicas {dims.dp_replicate}")
    parts += [f"EP {dims.ep} ({layout.exchange.name})", f"TP {dims.tp}", f"CP {dims.cp}"]
    experts = args.moe_args.num_experts
    where = "across nodes (RDMA)" if layout.spans_nodes(dims.ep) else "inside one node (NVLink)"
    lines.append(
        f"layout: {' x '.join(parts)}; {experts // dims.ep} of {experts} experts per GPU, the EP group {where}"
    )
    if dims.pp > 1:
        per_rank = len(layout.stages[0])
        lines.append(
            f"pipeline: {par.pipeline_parallel_schedule}, {per_rank} stage(s) per rank, {layout.microbatches} "
            f"micro-batches of {par.pipeline_parallel_microbatch_size} x {job.training.seq_len} tokens"
        )
    ac = job.activation_checkpoint
    peak = plan.peak
    counts = ", ".join(
        f"{peak.levels.count(level)} {level}" for level in ("none", "sac", "full") if level in peak.levels
    )
    budget = f", memory budget {ac.memory_budget_gib:g} GiB" if ac.memory_budget_gib > 0 else ""
    lines.append(
        f"batch: {job.training.local_batch_size} x {job.training.seq_len} tokens per data-parallel rank"
        f"{f', {layout.accumulation_steps} accumulation steps' if layout.accumulation_steps > 1 else ''}; "
        f"checkpointing {ac.mode}{budget}: the blocks of pipeline rank {peak.rank} at {counts}; "
        f"moments {job.optimizer.moments_dtype}"
    )
    return lines


def _memory(plan: Plan) -> list[str]:
    peak = plan.peak
    gpu = GPUS[plan.gpu]
    rank = (
        f" (pipeline rank {peak.rank}, the fullest; {peak.inflight} micro-batches in flight)"
        if len(plan.memory) > 1
        else ""
    )
    lines = [f"memory per GPU at the step's peak{rank}:"]
    for name, value in peak.categories.items():
        lines.append(f"  {name:<44}{value / GIB:8.1f} GiB")
    lines.append(f"  {'allocator: fragmentation and stream pools':<44}{peak.allocator_extra / GIB:8.1f} GiB")
    lines.append(f"  {'= reserved (the trainer logs it as memory)':<44}{peak.reserved / GIB:8.1f} GiB")
    for name, value in peak.outside_allocator.items():
        if value:
            lines.append(f"  {name + ' (outside the allocator)':<44}{value / GIB:8.1f} GiB")
    lines.append(f"  {'CUDA context, NCCL, workspaces':<44}{NON_ALLOCATOR_GIB:8.1f} GiB")
    card = peak.total + NON_ALLOCATOR_GIB * GIB
    verdict = "fits" if plan.fits else f"does NOT fit: {(card - gpu.memory_gib * GIB) / GIB:.1f} GiB over"
    lines.append(f"  {'= total':<44}{card / GIB:8.1f} GiB of {gpu.memory_gib:g} GiB ({gpu.name}): {verdict}")
    lines.append(f"  (all gradients: {peak.gradients_total / GIB:.1f} GiB; held at the peak as listed)")
    return lines


def _time(plan: Plan) -> list[str]:
    slowest = max(range(len(plan.time)), key=lambda r: plan.time[r].total)
    time = plan.time[slowest]
    rank = f" (pipeline rank {slowest}, the slowest)" if len(plan.time) > 1 else ""
    lines = [f"step time{rank}:"]
    for name, value in time.parts.items():
        if value:
            lines.append(f"  {name:<44}{value * 1e3:10.1f} ms")
    lines.append(f"  {'= step':<44}{time.total * 1e3:10.1f} ms")
    lines.append(
        f"predicted: {plan.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU, MFU {plan.mfu:.1%} (of "
        f"{GPUS[plan.gpu].bf16_tflops:g} TFLOP/s dense bf16), {plan.tokens_per_step:,} tokens per step"
    )
    return lines


def _assumptions(plan: Plan) -> list[str]:
    layout, dims, args, par = plan.layout, plan.layout.dims, plan.layout.args, plan.job.parallelism
    rates = GPU_RATES[plan.gpu]
    dense_speedup, grouped_speedup = shape_speedups(args)
    source = rates.dense_gemm_tflops.source
    lines = [
        "assumptions (measured rates from benchmarks/results; the rest stated):",
        f"  GEMMs: dense {rates.dense_gemm_tflops.value:g}, grouped {rates.grouped_gemm_tflops.value:g}; attention "
        f"fwd {rates.attention_fwd_tflops.value:g}, bwd {rates.attention_bwd_tflops.value:g} TFLOP/s ({source})",
    ]
    if dense_speedup != 1.0:
        lines.append(
            f"  the 671B's shapes: dense x{dense_speedup:.2f}, grouped x{grouped_speedup:.2f} "
            f"({SHAPE_RATES['linear_671b_ms'].source}, {SHAPE_RATES['grouped_671b'].source} against the 16B's)"
        )
    lines.append(
        f"  memory-bound kernels per token and layer, scaled by the shape's widths; AdamW at "
        f"{optimizer_bandwidth(plan.gpu) / 1e12:.2f} TB/s ({source})"
    )
    if section_groups(plan.job):
        lines.append(
            f"  Muon's Newton-Schulz at {newton_schulz_rate(plan.gpu) / 1e12:.0f} TFLOP/s, each rank its share of the "
            f"stacks (Muon's step over AdamW's: {MUON_STEP[0].source}, {MUON_STEP[1].source})"
        )
    lines.append(
        f"  activations: counted per token from the shapes x {ACTIVATION_SCALE} (one GPU's measured peak, "
        "e2e_16b8L_ep1_compile_sac_d128255.json)"
    )
    if dims.ep > 1:
        if layout.spans_nodes(dims.ep):
            rate = f"{DEEPEP_INTERNODE[0]:g} GB/s ({DEEPEP_INTERNODE[2]})"
        elif dims.ep >= 8:
            rate = f"{DEEPEP_INTRANODE_EP8[0]:g} / {DEEPEP_INTRANODE_EP8[1]:g} GB/s ({DEEPEP_INTRANODE_EP8[2]})"
        else:
            num_sms = timed_as(layout.exchange)[0].num_sms
            dispatch, combine = deepep_rates(num_sms)
            rate = f"{dispatch:.0f} / {combine:.0f} GB/s at {num_sms} SMs (deepep_bandwidth_ep2_16b_sms*.json)"
        exposed = rates.exchange_exposed_ms.value / (rates.exchange_exposed_ms.value + rates.exchange_hidden_ms.value)
        lines.append(
            f"  expert exchange: {ranks_per_token(args, dims.ep):.2f} ranks per token, dispatch / combine {rate}; "
            f"{exposed:.0%} of it exposed ({source}); busiest EP rank {imbalance(dims.ep):.2f}x the mean rows"
        )
    if dims.fsdp_enabled:
        gathers = "gathered twice (resharded after forward)" if reshards(layout) else "gathered once per step"
        lines.append(
            f"  FSDP: units {gathers}, fp32 reduce-scatters; {NVLINK.name} {NVLINK.gb_per_s:g} GB/s per direction "
            f"({NVLINK.source}) at {NCCL_NVLINK_EFFICIENCY:.0%} inside a node, {RDMA.name} {RDMA.gb_per_s:g} GB/s "
            f"across nodes ({RDMA.source})"
        )
    if dims.pp > 1:
        schedule = par.pipeline_parallel_schedule
        lines.append(
            f"  pipeline: {schedule}'s bubble {BUBBLE.get(schedule, 1.0):g} x (pp - 1) / stages-per-rank micro-batch "
            "slots; sends between stages counted as exposed (not measured: PP has not run on GPUs)"
        )
    lines.append(f"  GPU memory: {GPUS[plan.gpu].memory_source}")
    return lines


def _fixes(plan: Plan, fits: list[tuple[Change, Plan]]) -> list[str]:
    if not fits:
        return ["no change the plan knows (alone or up to three together) fits: more nodes, or a smaller model"]
    lines = ["changes that fit, fastest first (the first is the cheapest):"]
    for change, fitted in fits[:3]:
        card = fitted.peak.total / GIB + NON_ALLOCATOR_GIB
        nodes = f", {plan.nnodes + change.nodes} nodes" if change.nodes else ""
        lines.append(
            f"  {change.what}: {card:.1f} GiB per GPU, {fitted.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU "
            f"(MFU {fitted.mfu:.1%}){nodes}"
        )
        if change.flags:
            lines.append(f"    {' '.join(change.flags)}")
    return lines
