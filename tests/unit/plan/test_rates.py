"""Every rate and calibration constant of the plan is what the committed JSON it names says (so they cannot drift from
benchmarks/results), and the memory calibrations re-derive from their runs."""

import json
import re
from pathlib import Path

import pytest

from scripts.plan_check import job_of
from torchtitan.plan import memory, rates
from torchtitan.plan.__main__ import plan_from_argv
from torchtitan.plan.hardware import GPUS, NON_ALLOCATOR_GIB
from torchtitan.plan.memory import GIB
from torchtitan.plan.rates import Measured

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def lookup(source: str, key: str) -> float:
    value = json.loads((RESULTS / source).read_text())
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def every_measured() -> list[Measured]:
    found = [*rates.ATTENTION_FLOPS, *rates.IMBALANCE, *rates.SHAPE_RATES.values(), *rates.MUON_STEP]
    found += [m for pair in rates.DEEPEP_SM_SWEEP.values() for m in pair]
    for gpu_rates in rates.GPU_RATES.values():
        for value in gpu_rates.__dict__.values():
            found += list(value) if isinstance(value, tuple) else [value]
    return found


@pytest.mark.parametrize("measured", every_measured(), ids=lambda m: f"{m.source}:{m.key}")
def test_each_rate_is_its_json_value(measured):
    assert lookup(measured.source, measured.key) == pytest.approx(measured.value, rel=2e-3)


def test_the_muon_step_args_are_those_runs_jobs():
    """MUON_STEP_ARGS: the runs' own flags and, from their job file, the tokens per micro-batch; Muon and AdamW ran
    the same job apart from the optimizer."""
    muon, adamw = (json.loads((RESULTS / m.source).read_text()) for m in rates.MUON_STEP)
    flags, world, gpu = job_of(muon)
    assert (world, gpu) == (1, "h200") and muon["tokens_per_gpu_per_step"] == 4 * 4096
    from torchtitan.config import ConfigManager

    ran, planned = ConfigManager().parse_args(flags), ConfigManager().parse_args(list(rates.MUON_STEP_ARGS))
    for section, key in [("model", "flavor"), ("parallelism", "expert_parallel_degree"), ("optimizer", "name")] + [
        ("training", key) for key in ("local_batch_size", "seq_len", "global_batch_size")
    ]:
        assert getattr(getattr(ran, section), key) == getattr(getattr(planned, section), key), key
    assert [a for a in adamw["train_args"] if a not in ("AdamW", "Muon")] == [
        a for a in muon["train_args"] if a not in ("AdamW", "Muon")
    ]


def plan_of(source: str, *extra: str):
    flags, world, gpu = job_of(json.loads((RESULTS / source).read_text()))
    return plan_from_argv([*flags, *extra], nnodes=1, gpus_per_node=world, gpu=gpu)


def test_the_activation_scale_is_the_one_gpu_runs_peak_over_the_counted_activations(monkeypatch):
    source, scale = "e2e_16b8L_ep1_compile_sac_d128255.json", memory.ACTIVATION_SCALE
    monkeypatch.setattr(memory, "ACTIVATION_SCALE", 1.0)
    peak = plan_of(source).peak
    counted = next(value for name, value in peak.categories.items() if name.startswith("activations"))
    rest = peak.allocated - counted
    measured = lookup(source, "peak_memory_allocated_gib") * GIB
    assert (measured - rest) / counted == pytest.approx(scale, abs=1e-3)


def test_fragmentation_and_fsdp_pools_are_the_measured_reserved_over_allocated_gaps():
    one_gpu = "e2e_16b8L_ep1_compile_sac_d128255.json"
    ratio = lookup(one_gpu, "peak_memory_gib") / lookup(one_gpu, "peak_memory_allocated_gib")
    assert ratio - 1 == pytest.approx(memory.FRAGMENTATION, abs=5e-4)
    gaps = []
    for source in ("e2e_16b8L_ep2_24steps_deepep64_8f39102.json", "e2e_16b8L_ep4_deepep_sms48_d128255.json"):
        reserved, allocated = lookup(source, "peak_memory_gib"), lookup(source, "peak_memory_allocated_gib")
        gaps.append(reserved - allocated * (1 + memory.FRAGMENTATION))
    assert sum(gaps) / len(gaps) * GIB == pytest.approx(memory.FSDP_POOLS, abs=0.05 * GIB)


def test_output_head_constants_are_the_head_benchmarks_peaks():
    source = "output_head_16384x2048x102400_ebd51e2.json"
    rows, dim, vocab = lookup(source, "rows"), lookup(source, "dim"), lookup(source, "vocab")
    plain = lookup(source, "results.plain.peak_above_inputs_gib") * GIB
    assert plain / (rows * vocab) == pytest.approx(memory.PLAIN_HEAD_BYTES_PER_LOGIT, rel=0.01)
    # less the fp32 weight gradient and the bf16 input gradient, which the plan counts per head pass
    fused = lookup(source, "results.fused_chunk2048.peak_above_inputs_gib") * GIB - vocab * dim * 4 - rows * dim * 2
    assert fused / (memory.CHUNK_ROWS * vocab) == pytest.approx(memory.FUSED_HEAD_BYTES_PER_CHUNK_LOGIT, rel=0.02)


def test_the_h100s_memory_and_what_lives_outside_the_allocator_are_what_our_out_of_memory_runs_said():
    text = (RESULTS / "e2e_16b8L_ep1_compile_sac_h100_88e71a6_oom.json").read_text()
    reserved, percent = map(float, re.search(r"memory: ([0-9.]+)GiB\(([0-9.]+)%\)", text).groups())
    assert reserved / percent * 100 == pytest.approx(GPUS["h100"].memory_gib, abs=0.05)
    text = (RESULTS / "e2e_16b_ep4_sac_everywhere_oom_2251419.json").read_text()
    at, card = map(float, re.search(r"with ([0-9.]+) of ([0-9.]+) GiB reserved", text).groups())
    assert card == GPUS["h100"].memory_gib
    assert 0 < card - at <= NON_ALLOCATOR_GIB + 0.5  # the allocation that failed came on top
