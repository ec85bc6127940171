"""Muon's Newton-Schulz iteration on a rank: its FLOPs, spread as `components/muon.py` spreads them, at a measured rate.

Muon stacks the same-shape matrices of a model part and hands each rank whole matrices: where FSDP (and TP) shard a
matrix, the ranks that share it split the stack, so a rank runs ceil(count / ranks) of each shape; the routed experts
are split by EP (and FSDP over the experts, and ETP's shards) the same way. Each matrix costs `steps` x (4 m^2 n +
2 m^3) FLOPs for its m <= n sides (`scripts/bench/muon_step.py` counts the same).
"""

from __future__ import annotations

import math
from functools import cache

from torchtitan.models.moe.parallelize import experts_outside_fsdp
from torchtitan.plan.layout import Layout
from torchtitan.plan.rates import GPU_RATES, MUON_STEP, MUON_STEP_ARGS

__all__ = ["newton_schulz_flops", "newton_schulz_rate", "newton_schulz_seconds"]


def matrix_flops(rows: int, cols: int, steps: int) -> float:
    small, large = sorted((rows, cols))
    return steps * (4 * small * small * large + 2 * small**3)


def newton_schulz_flops(layout: Layout, rank: int) -> float:
    """The iteration's FLOPs a pipeline rank runs per optimizer step (0 unless the job's optimizer is Muon)."""
    opt, args, dims = layout.job.optimizer, layout.args, layout.dims
    if opt.name != "Muon":
        return 0.0
    groups = set(opt.muon_groups)
    # ranks that split each stack: FSDP's and TP's shards of a matrix; EP, FSDP over the experts and ETP for experts
    fsdp = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    sharing = {"matrices": fsdp * dims.tp, "router_gate": fsdp, "embeddings": fsdp * dims.tp, "head": fsdp * dims.tp}
    expert_fsdp = 1 if experts_outside_fsdp(dims, layout.job) else dims.dp_shard_mod_ep
    sharing["experts"] = dims.ep * expert_fsdp * max(dims.etp, 1)
    total = 0.0
    for stage in layout.stages[rank]:
        shapes: dict[tuple[str, int, int], int] = {}
        for block in stage.blocks:
            for key, count in block.matrices.items():
                shapes[key] = shapes.get(key, 0) + count
        if stage.embedding:
            shapes["embeddings", args.vocab_size, args.dim] = 1
        if stage.head:
            shapes["head", args.vocab_size, args.dim] = 1
        for (group, rows, cols), count in shapes.items():
            if group in groups:
                total += math.ceil(count / sharing[group]) * matrix_flops(rows, cols, opt.muon_ns_steps)
    return total


@cache
def newton_schulz_rate(gpu: str) -> float:
    """FLOP/s of the iteration, the copies around it included: what Muon added to the measured one-GPU step
    (rates.MUON_STEP, an H200) over its FLOPs; another GPU at the same share of its dense GEMM rate."""
    layout = muon_bench_layout()
    tokens = layout.microbatch_tokens * layout.microbatches * layout.accumulation_steps
    muon_tps, adamw_tps = (m.value for m in MUON_STEP)
    added = tokens / muon_tps - tokens / adamw_tps
    h200 = newton_schulz_flops(layout, 0) / added
    return h200 * GPU_RATES[gpu].dense_gemm_tflops.value / GPU_RATES["h200"].dense_gemm_tflops.value


@cache
def muon_bench_layout() -> Layout:
    """The layout of the runs behind rates.MUON_STEP (rates.MUON_STEP_ARGS on one GPU)."""
    from torchtitan.config import ConfigManager
    from torchtitan.preflight import check_layout

    job = ConfigManager().parse_args(list(MUON_STEP_ARGS))
    checked = check_layout(job, world_size=1)
    return Layout(checked.model_args, checked.parallel_dims, job, 8, checked.exchange)


def newton_schulz_seconds(layout: Layout, rank: int, gpu: str) -> float:
    return newton_schulz_flops(layout, rank) / newton_schulz_rate(gpu) if layout.job.optimizer.name == "Muon" else 0.0
