"""scripts/bench/e2e_trees.py: two trees' e2e runs compared (speed from the median of each tree's runs, losses and
memory from all of them), or one tree's runs with and without extra train args."""

import json
import sys

import pytest

from scripts.bench import e2e_trees
from scripts.bench.e2e_trees import compare


def _run(tps: float, losses: list[float], reserved: float | None = 70.0) -> dict:
    return {"tokens_per_sec_per_gpu": tps, "losses": losses, "peak_memory_gib": reserved,
            "peak_memory_allocated_gib": None if reserved is None else reserved - 1}  # fmt: skip


def test_compare_takes_each_trees_median_speed_and_the_first_runs_losses():
    old = [_run(100.0, [4.0, 4.0, 3.0, 3.0]), _run(104.0, [9.0] * 4), _run(90.0, [9.0] * 4, reserved=72.0)]
    new = [_run(120.0, [4.0, 4.4, 3.0, 3.0]), _run(110.0, [9.0] * 4)]
    result = compare(old, new, window=2)
    assert result["tokens_per_sec_per_gpu"] == {"old": 100.0, "new": 115.0}
    assert result["speedup"] == pytest.approx(1.15)
    assert result["max_rel_loss_diff"] == pytest.approx(0.1)  # step 2 of the first runs
    assert result["max_rel_loss_diff_2_step_windows"] == pytest.approx(0.05)  # steps 1-2: 4.2 vs 4.0
    assert result["peak_memory_gib"] == {"old": 72.0, "new": 70.0}
    assert result["peak_memory_allocated_gib"] == {"old": 71.0, "new": 69.0}


def test_compare_without_device_memory_says_none():
    result = compare([_run(1.0, [2.0], reserved=None)], [_run(1.0, [2.0], reserved=None)], window=1)
    assert result["peak_memory_gib"] == {"old": None, "new": None}


def test_compare_with_repeats_reports_the_old_trees_run_to_run_gap():
    old = [_run(100.0, [4.0, 4.0]), _run(100.0, [4.0, 4.2])]
    new = [_run(100.0, [4.0, 4.4]), _run(100.0, [4.4, 4.0])]
    result = compare(old, new, window=2)
    assert result["old_run_to_run"]["max_rel_loss_diff"] == pytest.approx(0.05)
    assert result["old_run_to_run"]["max_rel_loss_diff_2_step_windows"] == pytest.approx(0.025)
    by_repeat = result["new_vs_old_by_repeat"]
    assert [gaps["max_rel_loss_diff"] for gaps in by_repeat] == pytest.approx([0.1, 0.1])  # 4.4 vs 4.0, 4.4 vs 4.0
    assert by_repeat[1]["max_rel_loss_diff_2_step_windows"] == pytest.approx(0.2 / 8.2)
    assert "old_run_to_run" not in compare(old[:1], new[:1], window=2)


def test_one_tree_runs_the_new_args_against_its_default(monkeypatch, tmp_path):
    """Without --old both runs use this tree; only the new ones get --new-args, and the names tell them apart."""
    calls = []

    def fake_run(tree, commit, run_name, out_dir, args, train_args):
        calls.append((run_name, train_args))
        graphs = "--compile.cuda_graphs" in train_args
        return {"name": run_name, "returncode": 0, "cuda_graphs": graphs, **_run(2.0 if graphs else 1.0, [3.0])}

    monkeypatch.setattr(e2e_trees, "run_e2e", fake_run)
    monkeypatch.setattr(e2e_trees, "git_commit", lambda: "abc123")
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    argv = ["e2e_trees.py", "--name", "g", "--ngpu", "1", "--repeats", "2", "--new-args=--compile.cuda_graphs", "--",
            "--training.steps", "4"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert e2e_trees.main() == 0
    base, graphs = ["--training.steps", "4"], ["--training.steps", "4", "--compile.cuda_graphs"]
    assert calls == [("g_abc123_old_r1", base), ("g_abc123_new_r1", graphs), ("g_abc123_old_r2", base),
                     ("g_abc123_new_r2", graphs)]  # fmt: skip
    summary = json.loads((tmp_path / "compare_g.json").read_text())
    assert summary["cuda_graphs"] == {"old": False, "new": True}
    assert summary["speedup"] == pytest.approx(2.0)
    assert summary["new_args"] == ["--compile.cuda_graphs"]
