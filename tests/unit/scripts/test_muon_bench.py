"""scripts/bench/muon_vs_adamw.py's comparison and Muon's Newton-Schulz FLOP count (components/muon.py, which
muon_step.py and the plan use)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scripts.bench.muon_vs_adamw import adamw_update_rms, compare, muon_group_sizes
from torchtitan.components.muon import newton_schulz, newton_schulz_flops


def _run(tps: float, losses: list[float], memory: float | None = 70.0) -> dict:
    return {"tokens_per_sec_per_gpu": tps, "tokens_per_gpu_per_step": 1000, "losses": losses, "peak_memory_gib": memory}


def test_compare_gives_step_times_their_ratio_and_the_loss_gaps():
    adamw = [_run(100.0, [4.0, 3.0, 2.0]), _run(110.0, [9.0] * 3, memory=72.0)]
    muon = [_run(95.0, [4.0, 3.3, 2.2]), _run(97.0, [9.0] * 3)]
    result = compare({"AdamW": adamw, "Muon": muon}, window=3)
    assert result["tokens_per_sec_per_gpu"] == {"AdamW": 105.0, "Muon": 96.0}
    assert result["step_ms"]["AdamW"] == pytest.approx(1000 / 105 * 1e3)
    assert result["muon_step_time_over_adamw"] == pytest.approx(105 / 96)
    assert result["peak_memory_gib"] == {"AdamW": 72.0, "Muon": 70.0}
    assert result["end_loss"] == pytest.approx({"AdamW": 3.0, "Muon": 3.1666666})  # the first runs' losses
    assert result["muon_loss_gap_end"] == pytest.approx(0.1666666 / 3)
    assert result["muon_max_loss_gap_3_step_windows"] == pytest.approx(0.1666666 / 3)


def test_compare_without_device_memory_says_none():
    result = compare({"AdamW": [_run(1.0, [2.0], None)], "Muon": [_run(1.0, [2.0], None)]}, window=1)
    assert result["peak_memory_gib"] == {"AdamW": None, "Muon": None}


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (16, 16)])
def test_newton_schulz_flops_count_what_torch_counts(shape):
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.zeros(shape).reshape(-1, *shape[-2:]), steps=5)
    assert newton_schulz_flops(torch.Size(shape), steps=5) == counter.get_total_flops()


def test_the_matched_update_rms_weights_groups_by_size_and_steps_by_lr():
    # step 1: RMS 1 over both groups; step 2: sqrt((3 x 0.5^2 + 1 x 0.1^2) / 4) = 0.4359; lr weights 1 : 3
    result = {
        "update_rms": {"experts": [1.0, 0.5], "matrices": [1.0, 0.1], "head": [9.0, 9.0]},
        "update_rms_lr": [1, 3],
    }
    expected = (1.0 + 3 * ((3 * 0.25 + 0.01) / 4) ** 0.5) / 4
    assert adamw_update_rms(result, {"experts": 3, "matrices": 1}) == pytest.approx(expected)


def test_muon_group_sizes_are_the_muon_groups_parameter_counts():
    args = ["--model.flavor", "debugmodel_tiny", "--muon.groups", "experts,head"]
    sizes = muon_group_sizes("./train_configs/deepseek_v3_debugmodel.toml", args)
    assert set(sizes) == {"experts", "head"} and all(size > 0 for size in sizes.values())
