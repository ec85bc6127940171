"""Step time of a pipeline rank, by part, from our measured rates (`rates.py`) and stated bandwidths (`hardware.py`).

Per micro-batch a rank runs its blocks' GEMMs (dense at the dense rate, the routed experts at the grouped rate, the
busiest EP rank's share of them), attention (causal FLOPs at the measured forward and backward rates), the
memory-bound kernels (measured per token and layer, scaled by the shape's widths), whole-block recomputes, and the
expert exchange's exposed share; per optimizer step the AdamW pass (its bytes at the measured bandwidth; Muon's
parameters counted the same), Muon's Newton-Schulz iteration (`newton_schulz.py`) and FSDP's collectives beyond what
compute hides; with pipeline parallelism the schedule's bubble and the stage-to-stage sends.
The profiles' idle time is not added: it is the profiler's own host cost (unprofiled steps of the same runs match the
sum of the kernels within 3%).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from torchtitan.components.optimizer import section_groups
from torchtitan.models.moe.exchange import DeepEPBackend, ExchangeBackend
from torchtitan.plan.hardware import DEEPEP_INTERNODE, DEEPEP_INTRANODE_EP8, NVLINK, RDMA
from torchtitan.plan.layout import Layout, dense_params, frozen, frozen_dense_params, layout_from_flags, ranks_per_token
from torchtitan.plan.memory import imbalance, reshards, storage
from torchtitan.plan.newton_schulz import newton_schulz_seconds
from torchtitan.plan.rates import (
    ATTENTION_FLOPS,
    DEEPEP_SM_SWEEP,
    GPU_RATES,
    PROFILE_LAYERS,
    PROFILE_MOE_LAYERS,
    PROFILE_TOKENS,
    PROFILED_ARGS,
    SHAPE_RATES,
)

__all__ = ["BUBBLE", "NCCL_NVLINK_EFFICIENCY", "RankTime", "optimizer_bytes", "rank_time"]

NCCL_NVLINK_EFFICIENCY = 0.8
"""FSDP's all-gathers and reduce-scatters inside a node: assumed at 80% of NVLink's per-direction bandwidth."""
STANDARD_EXCHANGE_SLOWDOWN = 1.07
"""The all-to-all backend's step against deepep's at EP2 (1.06-1.08x, benchmarks/NOTES.md, 8f39102 / 58c3359)."""
BUBBLE = {"GPipe": 1.0, "1F1B": 1.0, "Interleaved1F1B": 1.0, "ZBVZeroBubble": 0.5, "DualPipeV": 0.5}
"""Idle micro-batch slots per (pp - 1) / (stages per rank): 1F1B-like schedules lose pp - 1 slots, shared by the
interleaved stages; the zero-bubble V schedules are assumed to halve that (not measured)."""
PARTS = ("dense GEMMs", "grouped GEMMs", "attention", "memory-bound kernels", "recompute (whole blocks)",
         "expert exchange (exposed)")  # fmt: skip


@dataclass
class RankTime:
    """Seconds per optimizer step of one pipeline rank, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def rank_time(layout: Layout, rank: int, levels: list[list[str]], gpu: str) -> RankTime:
    args, dims, job = layout.args, layout.dims, layout.job
    rates = GPU_RATES[gpu]
    tokens = layout.microbatch_tokens
    dense_rate = rates.dense_gemm_tflops.value * 1e12 * shape_speedups(args)[0]
    grouped_rate = rates.grouped_gemm_tflops.value * 1e12 * shape_speedups(args)[1]
    fwd_rate, bwd_rate = rates.attention_fwd_tflops.value * 1e12, rates.attention_bwd_tflops.value * 1e12
    bwd_flops = ATTENTION_FLOPS[1].value / ATTENTION_FLOPS[0].value
    # FLOPs per token: the routed experts' (the busiest EP rank's share of copies), attention's (causal)
    expert_flops = 18 * args.dim * args.moe_inter_dim * args.moe_args.top_k * imbalance(dims.ep) / max(dims.etp, 1)
    attention_fwd = args.n_heads // dims.tp * (args.qk_head_dim + args.v_head_dim) * job.training.seq_len
    elementwise = sum(m.value for m in rates.elementwise_ms) / 1e3 / (PROFILE_TOKENS * PROFILE_LAYERS)
    elementwise *= _elementwise_scale(args)
    moe_glue = rates.moe_glue_ms.value / 1e3 / (PROFILE_TOKENS * PROFILE_MOE_LAYERS) * _moe_glue_scale(args, dims.ep)
    exposed = rates.exchange_exposed_ms.value / (rates.exchange_exposed_ms.value + rates.exchange_hidden_ms.value)
    exchange = exchange_seconds(layout, tokens) * exposed  # one dispatch + one combine, exposed share

    t = dict.fromkeys(PARTS, 0.0)
    for stage, stage_levels in zip(layout.stages[rank], levels, strict=True):
        dense = dense_params(stage.params())
        if stage.head:  # each MTP module runs the output head again
            dense += args.mtp_layers * stage.head.params["head"]
        # a frozen weight (LoRA's base) computes no weight gradient: 4 FLOPs per parameter and token, not 6
        t["dense GEMMs"] += (6 * dense - 2 * frozen_dense_params(stage.params())) * tokens / dims.tp / dense_rate
        for block, level in zip(stage.blocks, stage_levels, strict=True):
            frozen_experts = block.params[frozen("experts")] > 0
            grouped = tokens * expert_flops * (2 / 3 if frozen_experts else 1) / grouped_rate if block.moe else 0.0
            attention_f = tokens * attention_fwd / fwd_rate
            glue = tokens * (elementwise + (moe_glue if block.moe else 0.0))
            t["grouped GEMMs"] += grouped
            t["attention"] += attention_f + tokens * attention_fwd * bwd_flops / bwd_rate
            t["memory-bound kernels"] += glue
            t["expert exchange (exposed)"] += 2 * exchange if block.moe else 0.0
            if level == "full":  # the forward again in backward, its exchange too
                forward_grouped = tokens * expert_flops / 3 / grouped_rate if block.moe else 0.0
                block_dense = 2 * tokens * dense_params(block.params) / dims.tp / dense_rate
                t["recompute (whole blocks)"] += block_dense + forward_grouped + glue / 3 + attention_f
                t["recompute (whole blocks)"] += exchange if block.moe else 0.0
    micro = layout.microbatches * layout.accumulation_steps
    seconds = {name: value * micro for name, value in t.items()}
    if dims.pp > 1:
        per_rank = len(layout.stages[rank])
        slots = BUBBLE.get(job.parallelism.pipeline_parallel_schedule, 1.0) * (dims.pp - 1) / per_rank
        seconds["pipeline bubble"] = sum(t.values()) * slots * layout.accumulation_steps
        seconds["pipeline sends (fill and drain)"] = _pipeline_send_seconds(layout, rank) * layout.accumulation_steps
    seconds["optimizer"] = optimizer_bytes(layout, rank) / optimizer_bandwidth(gpu)
    if section_groups(job):
        seconds["Muon's Newton-Schulz"] = newton_schulz_seconds(layout, rank, gpu)
    seconds["FSDP collectives (exposed)"] = _fsdp_exposed_seconds(layout, rank, sum(seconds.values()))
    return RankTime(seconds)


def optimizer_bytes(layout: Layout, rank: int) -> float:
    """Bytes the AdamW step moves on a rank: each weight (and its master bits) read and written, its gradient read
    twice (the clipping norm, the update), both moments read and written."""
    groups = storage(layout)
    total = 0.0
    for stage in layout.stages[rank]:
        for group, count in stage.params().items():
            s = groups[group]
            if s.moments:  # what the optimizer steps (not a frozen base)
                total += count * s.local / s.shard * 2 * (s.weight + s.master_bits + s.grad + s.moments)
    return total


@cache
def optimizer_bandwidth(gpu: str) -> float:
    """Bytes/s of the AdamW step: the profiled run's optimizer bytes over its measured time."""
    return optimizer_bytes(profiled_layout(), 0) / (GPU_RATES[gpu].optimizer_ms.value / 1e3)


@cache
def profiled_layout() -> Layout:
    """The layout of the profiled run behind rates.GPU_RATES (rates.PROFILED_ARGS on 2 GPUs)."""
    return layout_from_flags(PROFILED_ARGS, world_size=2)


def exchange_seconds(layout: Layout, tokens: int) -> float:
    """One dispatch and one combine of one MoE layer's micro-batch on the busiest rank (backward repeats the pair):
    the tokens it receives (each token once per rank its experts are on) over DeepEP's rates."""
    dims, args = layout.dims, layout.args
    if dims.ep <= 1:
        return 0.0
    measured, slowdown = timed_as(layout.exchange)
    received = tokens * ranks_per_token(args, dims.ep) * args.dim * 2 * imbalance(dims.ep)
    if layout.spans_nodes(dims.ep):
        dispatch, combine = DEEPEP_INTERNODE[:2]
    elif dims.ep >= 8:
        dispatch, combine = DEEPEP_INTRANODE_EP8[:2]
    else:
        dispatch, combine = deepep_rates(measured.num_sms)
    seconds = received / (dispatch * 1e9) + received / (combine * 1e9)
    return seconds * slowdown


def timed_as(exchange: ExchangeBackend) -> tuple[DeepEPBackend, float]:
    """The DeepEP exchange whose measured rates time `exchange`, and the factor on that time: DeepEP at its own
    settings; any other backend as DeepEP at its defaults x STANDARD_EXCHANGE_SLOWDOWN (the all-to-all's measured
    step: no other backend is measured)."""
    if isinstance(exchange, DeepEPBackend):
        return exchange, 1.0
    return DeepEPBackend(), STANDARD_EXCHANGE_SLOWDOWN


def deepep_rates(num_sms: int) -> tuple[float, float]:
    """Dispatch and combine GB/s at `num_sms`, interpolated in the measured SM sweep (clamped at its ends)."""
    points = sorted((sms, (d.value, c.value)) for sms, (d, c) in DEEPEP_SM_SWEEP.items())
    if num_sms <= points[0][0]:
        return points[0][1]
    for (lo, lo_rates), (hi, hi_rates) in zip(points, points[1:], strict=False):
        if num_sms <= hi:
            f = (num_sms - lo) / (hi - lo)
            return lo_rates[0] + f * (hi_rates[0] - lo_rates[0]), lo_rates[1] + f * (hi_rates[1] - lo_rates[1])
    return points[-1][1]


def _fsdp_exposed_seconds(layout: Layout, rank: int, compute: float) -> float:
    """FSDP's all-gathers (once per step; twice when units reshard) and fp32 reduce-scatters, plus HSDP's all-reduce
    of the shards over the replicas: the first unit's gather and the last unit's reduce are exposed, the rest hides
    behind compute up to its length."""
    dims = layout.dims
    if not dims.fsdp_enabled:
        return 0.0
    groups = storage(layout)
    gathers = 2 if reshards(layout) else 1
    per_unit = []
    for unit in (u for stage in layout.stages[rank] for u in stage.units()):
        seconds = 0.0
        for group, count in unit.items():
            s = groups[group]
            if s.gathered and s.shard > 1:
                stride = dims.ep if group in ("experts", frozen("experts")) else dims.tp
                reduced = 4 if s.grad else 0  # the fp32 gradients' reduce-scatter (none for a frozen base)
                moved = count * s.local * (s.shard - 1) / s.shard * (gathers * s.gathered + reduced)
                seconds += moved / _collective_bandwidth(layout, s.shard, stride)
        per_unit.append(seconds)
    if not per_unit:
        return 0.0
    edges = (per_unit[0] + per_unit[-1]) / (gathers + 1)
    total = sum(per_unit)
    if dims.dp_replicate > 1:
        replicas = dims.dp_replicate
        shard_grads = sum(
            count * groups[group].local / groups[group].shard * (4 if groups[group].grad else 0)
            for stage in layout.stages[rank]
            for group, count in stage.params().items()
        )
        total += 2 * shard_grads * (replicas - 1) / replicas / (RDMA.gb_per_s * 1e9)
    return edges + max(0.0, total - edges - compute)


def _collective_bandwidth(layout: Layout, group: int, stride: int) -> float:
    if layout.spans_nodes(group, stride):
        return RDMA.gb_per_s * 1e9
    return NCCL_NVLINK_EFFICIENCY * NVLINK.gb_per_s * 1e9


def _pipeline_send_seconds(layout: Layout, rank: int) -> float:
    """The hidden states (and MTP's embeddings) sent to the next stage and their gradients sent back: in the steady
    state they overlap compute; on the fill and the drain every hop between the pp x v stages waits for one."""
    dims, args = layout.dims, layout.args
    stride = dims.world_size // dims.pp
    bandwidth = RDMA.gb_per_s * 1e9 if layout.spans_nodes(dims.pp, stride) else NVLINK.gb_per_s * 1e9
    hops = dims.pp * len(layout.stages[rank]) - 1
    activation = layout.microbatch_tokens * args.dim * 2 * (1 + args.mtp_layers)
    return 2 * hops * activation / bandwidth


def linear_fwd_bwd_flops(args: Any, tokens: int) -> float:
    """FLOPs of the linears `scripts/bench/linear.py` times for a model (one of each attention projection, the
    shared experts' w1 and w2, the dense FFN's w1 and w2), forward and backward."""
    heads, dim = args.n_heads, args.dim
    shapes = [(dim, args.kv_lora_rank + args.qk_rope_head_dim)]
    shapes += [(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim)), (heads * args.v_head_dim, dim)]
    if args.q_lora_rank:
        shapes += [(dim, args.q_lora_rank), (args.q_lora_rank, heads * args.qk_head_dim)]
    else:
        shapes += [(dim, heads * args.qk_head_dim)]
    shared = args.moe_inter_dim * args.moe_args.num_shared_experts
    shapes += [(dim, shared), (shared, dim), (dim, args.inter_dim), (args.inter_dim, dim)]
    return 6 * tokens * sum(i * o for i, o in shapes)


@cache
def _linear_tflops() -> tuple[float, float]:
    small = linear_fwd_bwd_flops(_benchmarked_args("16B"), 16384) / (SHAPE_RATES["linear_16b_ms"].value / 1e3)
    large = linear_fwd_bwd_flops(_benchmarked_args("671B"), 8192) / (SHAPE_RATES["linear_671b_ms"].value / 1e3)
    return small / 1e12, large / 1e12


def _benchmarked_args(flavor: str) -> Any:
    """The args of a shape the linear benchmarks timed: the trainer's default model at `flavor`, through its spec."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.spec import get_model_spec

    job = ConfigManager().parse_args(["--model.flavor", flavor])
    return get_model_spec(job.model.name).model_args(job)


def shape_speedups(args: Any) -> tuple[float, float]:
    """(dense, grouped) GEMM rates of a 671B-wide model (dim >= 7168) over the profiled 16B's: the benchmarks of
    both shapes on one H200 (rates.SHAPE_RATES); 1 for the 16B's shapes."""
    if args.dim < 7168:
        return 1.0, 1.0
    small, large = _linear_tflops()
    return large / small, SHAPE_RATES["grouped_671b"].value / SHAPE_RATES["grouped_16b"].value


def _elementwise_scale(args: Any) -> float:
    """Memory-bound work per token and layer against the profiled 16B shape: norms, residuals, RoPE and casts grow
    with the hidden size and the heads' widths."""
    width = args.dim + args.n_heads * (args.qk_head_dim + args.v_head_dim)
    return width / (2048 + 16 * (192 + 128))


def _moe_glue_scale(args: Any, ep: int) -> float:
    """The gathers into the experts' rows and back per token (top_k copies of dim + hidden values; the 16B's 6 x
    (2048 + 1408) profiled) and the received tokens' reordering, which grows with EP (21.9 ms at EP4 against 16.2 at
    EP2 and 12.3 at EP1 in the H100 / H200 profiles: about +15% per doubling)."""
    m = args.moe_args
    return m.top_k * (args.dim + args.moe_inter_dim) / (6 * (2048 + 1408)) * (1 + 0.15 * (ep.bit_length() - 1)) / 1.15
