"""What our own runs measured, as the plan's rates: each constant names the committed JSON under benchmarks/results
it was read from and where in it (`tests/unit/plan/test_rates.py` reads every one back, so they cannot drift).

The per-class rates come from one profiled step of 16B_bench4 at FSDP2 x EP2 (deepep, compile + per-op SAC, 4 x 4096
tokens per GPU: PROFILED_ARGS), the newest profile with a per-class breakdown on each GPU kind
(`scripts/bench/trace_breakdown.py`: tflop_per_s is the FLOPs the class's kernels did over their time; attention
counts causal FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEEPEP_SM_SWEEP",
    "GPU_RATES",
    "GpuRates",
    "IMBALANCE",
    "MUON_STEP",
    "MUON_STEP_ARGS",
    "Measured",
    "SHAPE_RATES",
]


@dataclass(frozen=True)
class Measured:
    value: float
    source: str
    """File under benchmarks/results."""
    key: str
    """Dotted path to the value in that JSON (list items by index)."""


@dataclass(frozen=True)
class GpuRates:
    grouped_gemm_tflops: Measured
    dense_gemm_tflops: Measured
    """Every nn.Linear's GEMMs, the output head's included."""
    attention_fwd_tflops: Measured
    attention_bwd_tflops: Measured
    optimizer_ms: Measured
    """The AdamW step (and clipping norm) of the profiled run; its bytes come from the plan's own count."""
    elementwise_ms: tuple[Measured, ...]
    """Norms and elementwise kernels, casts and copies, the rest: spread over the profile's tokens x layers."""
    moe_glue_ms: Measured
    """The MoE's gathers, scatters and routing kernels: spread over the profile's tokens x MoE layers."""
    exchange_exposed_ms: Measured
    exchange_hidden_ms: Measured
    """DeepEP's kernels outside / under compute on the profiled rank: the exposed share of an exchange."""


_CLASSES = "profile_breakdown.steps.0.classes"


def _profile(source: str, values: dict[str, float]) -> GpuRates:
    """A GPU's rates from one profiled step (rank 0, which ran the most expert rows in both profiles)."""

    def at(key: str, name: str) -> Measured:
        return Measured(values[name], source, key)

    return GpuRates(
        grouped_gemm_tflops=at(f"{_CLASSES}.grouped_gemm.tflop_per_s", "grouped_gemm"),
        dense_gemm_tflops=at(f"{_CLASSES}.dense_gemm.tflop_per_s", "dense_gemm"),
        attention_fwd_tflops=at(f"{_CLASSES}.attention_fwd.tflop_per_s", "attention_fwd"),
        attention_bwd_tflops=at(f"{_CLASSES}.attention_bwd.tflop_per_s", "attention_bwd"),
        optimizer_ms=at(f"{_CLASSES}.optimizer.ms", "optimizer"),
        elementwise_ms=tuple(
            at(f"{_CLASSES}.{name}.ms", name) for name in ("norms_elementwise", "casts_copies", "other")
        ),
        moe_glue_ms=at(f"{_CLASSES}.moe_glue.ms", "moe_glue"),
        exchange_exposed_ms=at("profile_ranks.ranks.0.exposed_ms.exchange", "exposed"),
        exchange_hidden_ms=at("profile_ranks.ranks.0.hidden_ms.exchange", "hidden"),
    )


GPU_RATES = {
    "h100": _profile(  # 2 x H100 at d128255 (24 DeepEP SMs)
        "e2e_16b8L_ep2_deepep_sac_d128255.json",
        dict(
            grouped_gemm=598.6,
            dense_gemm=678.1,
            attention_fwd=516.2,
            attention_bwd=418.8,
            optimizer=24.19,
            norms_elementwise=25.55,
            casts_copies=5.94,
            other=3.46,
            moe_glue=16.19,
            exposed=15.67,
            hidden=8.35,
        ),
    ),  # fmt: skip
    "h200": _profile(  # 2 x H200 at 09a0823 (the routed experts as one compiled region)
        "e2e_16b8L_ep2_deepep_sac_fused_experts_09a0823_r1.json",
        dict(
            grouped_gemm=589.8,
            dense_gemm=668.5,
            attention_fwd=547.6,
            attention_bwd=389.2,
            optimizer=17.37,
            norms_elementwise=20.35,
            casts_copies=4.12,
            other=3.03,
            moe_glue=14.05,
            exposed=15.8,
            hidden=8.36,
        ),
    ),  # fmt: skip
}
PROFILED_ARGS = ("--model.flavor", "16B_bench4", "--parallelism.expert_parallel_degree", "2")
"""The profiled runs' job on 2 GPUs (the trainer's defaults otherwise): its layout gives the optimizer's bytes."""
PROFILE_TOKENS, PROFILE_LAYERS, PROFILE_MOE_LAYERS = 16384, 8, 7

ATTENTION_FLOPS = (
    Measured(2.749, "e2e_16b8L_ep2_deepep_sac_d128255.json", f"{_CLASSES}.attention_fwd.tflop"),
    Measured(7.147, "e2e_16b8L_ep2_deepep_sac_d128255.json", f"{_CLASSES}.attention_bwd.tflop"),
)
"""Attention's forward and backward FLOPs as the profiles count them: backward is 2.6x forward."""

SHAPE_RATES = {
    "grouped_16b": Measured(524.9, "grouped_gemm_16b_ep1_t16384.json", "bare_grouped_mm.fwd_bwd_tflops"),
    "grouped_671b": Measured(583.2, "grouped_gemm_671b_ep4_t8192.json", "bare_grouped_mm.fwd_bwd_tflops"),
    "linear_16b_ms": Measured(11.90, "linear_16B_t16384.json", "total.bf16_fwd_bwd_ms"),
    "linear_671b_ms": Measured(36.95, "linear_671B_t8192.json", "total.bf16_fwd_bwd_ms"),
}
"""The GEMMs of the 671B's shapes against the 16B's (one H200, bf16 fwd+bwd): grouped GEMMs 1.11x, the linears
1.10x (their FLOPs over the JSON's total time, `speed.shape_speedups`)."""

DEEPEP_SM_SWEEP = {
    sms: (
        Measured(dispatch, f"deepep_bandwidth_ep2_16b_sms{sms}.json", "dispatch_gbps"),
        Measured(combine, f"deepep_bandwidth_ep2_16b_sms{sms}.json", "combine_gbps"),
    )
    for sms, dispatch, combine in ((24, 120.6, 180.0), (32, 141.8, 226.1), (48, 168.0, 270.1), (64, 212.4, 364.0))
}
"""DeepEP's intranode dispatch / combine at EP2 on H100s by SM count: GB/s of received tokens (16,384 tokens x 2048,
top-6 of 64). Used at EP 2 and 4; EP8 takes DeepEP's published figures (hardware.DEEPEP_INTRANODE_EP8)."""

IMBALANCE = (
    Measured(1.073, "e2e_16b8L_ep2_deepep_sac_d128255.json", "profile_ranks.summary.grouped_gemm_ms_max_over_mean"),
    Measured(1.188, "e2e_16b8L_ep4_deepep_sac_2251419.json", "profile_ranks.summary.grouped_gemm_ms_max_over_mean"),
)
"""The busiest rank's grouped-GEMM time over the mean at EP2 and EP4 (natural routing, step 12 of a fresh run): the
plan takes 1 + 0.1 sqrt(EP - 1) (1.10 at EP2, 1.17 at EP4, 1.26 at EP8; `memory.imbalance`). The expert-bias
balancing lowers it over training."""

MUON_STEP = (
    Measured(52350.6, "e2e_16b8L_1gpu_gbs16_muon_300steps_498a64b.json", "tokens_per_sec_per_gpu"),
    Measured(71604.1, "e2e_16b8L_1gpu_gbs16_adamw_300steps_498a64b.json", "tokens_per_sec_per_gpu"),
)
"""Muon's and AdamW's tokens/s on 16B_bench4, one H200, 4 x 16,384 tokens a step (two calls on one machine, 300 steps
each): the difference of their step times is what Muon adds, its Newton-Schulz iteration with the copies around it;
over the iteration's FLOPs it gives the rate the plan runs Newton-Schulz at (`newton_schulz.newton_schulz_rate`)."""
MUON_STEP_ARGS = ("--model.flavor", "16B_bench4", "--parallelism.expert_parallel_degree", "1",
                  "--training.local_batch_size", "4", "--training.seq_len", "4096",
                  "--training.global_batch_size", "16", "--optimizer.name", "Muon")  # fmt: skip
"""What of the MUON_STEP runs' job sets the iteration's FLOPs and the tokens a step (the runs: the 16B job file)."""
