"""Muon's Newton-Schulz iteration on a rank: its FLOPs, spread as `components/muon.py` spreads them, at a measured rate.

Muon stacks the same-shape matrices of a model part and hands each rank whole matrices: where FSDP (and TP) shard a
matrix, the ranks that share it split the stack, so a rank runs ceil(count / ranks) of each shape; the routed experts
are split by EP (and FSDP over the experts, and ETP's shards) the same way. Each matrix costs what the optimizer
says a step of it costs (`components/optimizer.py`'s `grouped_step_flops`: Muon's `step_flops`).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

from torchtitan.components.optimizer import grouped_step_flops, section_groups
from torchtitan.models.moe.parallelize import experts_outside_fsdp
from torchtitan.plan.layout import Layout, layout_from_flags
from torchtitan.plan.rates import GPU_RATES, MUON_STEP, MUON_STEP_ARGS

__all__ = ["newton_schulz_flops", "newton_schulz_rate", "newton_schulz_seconds"]


def newton_schulz_flops(layout: Layout, rank: int) -> float:
    """The iteration's FLOPs a pipeline rank runs per optimizer step (0 unless the job's optimizer is Muon)."""
    job, dims = layout.job, layout.dims
    groups = section_groups(job)
    # ranks that split each stack: FSDP's and TP's shards of a matrix; EP, FSDP over the experts and ETP for experts
    fsdp = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    sharing = {"matrices": fsdp * dims.tp, "router_gate": fsdp, "embeddings": fsdp * dims.tp, "head": fsdp * dims.tp}
    expert_fsdp = 1 if experts_outside_fsdp(dims, job) else dims.dp_shard_mod_ep
    sharing["experts"] = dims.ep * expert_fsdp * max(dims.etp, 1)
    total = 0.0
    for stage in layout.stages[rank]:
        shapes = sum((part.matrices for part in stage.parts()), Counter())
        for (group, rows, cols), count in shapes.items():
            if group in groups:
                total += math.ceil(count / sharing[group]) * grouped_step_flops(job, (rows, cols))
    return total


@cache
def newton_schulz_rate(gpu: str) -> float:
    """FLOP/s of the iteration, the copies around it included: what Muon added to the measured one-GPU step
    (rates.MUON_STEP, an H200) over its FLOPs; another GPU at the same share of its dense GEMM rate."""
    layout = layout_from_flags(MUON_STEP_ARGS, world_size=1)
    tokens = layout.microbatch_tokens * layout.microbatches * layout.accumulation_steps
    muon_tps, adamw_tps = (m.value for m in MUON_STEP)
    added = tokens / muon_tps - tokens / adamw_tps
    h200 = newton_schulz_flops(layout, 0) / added
    return h200 * GPU_RATES[gpu].dense_gemm_tflops.value / GPU_RATES["h200"].dense_gemm_tflops.value


def newton_schulz_seconds(layout: Layout, rank: int, gpu: str) -> float:
    return newton_schulz_flops(layout, rank) / newton_schulz_rate(gpu)
