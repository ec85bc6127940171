"""The straggler check: each rank's own step time, the slowest rank and its ratio, the warning after K checks."""

import logging

import pytest
import torch

from torchtitan.components.fault_tolerance import stragglers
from torchtitan.components.fault_tolerance.stragglers import StragglerCheck, own_step_seconds


def test_a_rank_slow_to_load_keeps_its_step_time_and_the_others_lose_what_they_waited_for_it():
    # every rank's wall step time is 0.5 s; rank 1 spent 0.3 s of it loading its batch, the others 0.01 s
    own = own_step_seconds([0.5, 0.5, 0.5], [0.01, 0.3, 0.01])
    assert own == pytest.approx([0.21, 0.5, 0.21])


def checks(monkeypatch, windows: list[list[tuple[float, float]]], warn_after: int = 2) -> list:
    """Run `StragglerCheck.check` once per window of (step seconds, data wait) per rank, as rank 0 sees it."""
    check = StragglerCheck(interval=2, threshold=1.2, warn_after=warn_after, group=None, rank=0)
    reports = []
    for step, window in enumerate(windows, start=1):
        monkeypatch.setattr(stragglers.dist, "get_world_size", lambda group, window=window: len(window))

        def all_gather(gathered, mine, group, window=window):
            for out, (step_seconds, data_wait) in zip(gathered, window, strict=True):
                out.copy_(torch.tensor([step_seconds, data_wait], dtype=torch.float64))

        monkeypatch.setattr(stragglers.dist, "all_gather", all_gather)
        check.add(*window[0])
        reports.append(check.check(2 * step))
    return reports


def test_the_report_names_the_slowest_rank_and_its_ratio_to_the_median(monkeypatch):
    (report,) = checks(monkeypatch, [[(0.5, 0.01), (0.5, 0.01), (0.5, 0.31), (0.5, 0.01)]])
    assert report.slowest_rank == 2
    assert report.ratio == pytest.approx(0.5 / 0.2)
    assert report.record() == {
        "straggler/slowest_rank": 2,
        "straggler/ratio": pytest.approx(2.5),
        "straggler/median_step_seconds": pytest.approx(0.2),
        "straggler/slowest_data_wait_seconds": pytest.approx(0.31),
    }


def test_the_warning_comes_once_the_same_rank_is_over_the_threshold_at_k_checks_in_a_row(monkeypatch, caplog):
    slow_1 = [(0.5, 0.0), (0.5, 0.3)]
    slow_0 = [(0.5, 0.3), (0.5, 0.0)]
    even = [(0.5, 0.0), (0.5, 0.0)]
    with caplog.at_level(logging.WARNING):
        checks(monkeypatch, [slow_1, slow_0, slow_1, even, slow_1])  # never twice in a row
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        checks(monkeypatch, [slow_1, slow_1, slow_1])
    (warning,) = caplog.records  # once per streak, at its second check
    assert warning.getMessage().startswith("straggler: rank 1 has been the slowest for 2 checks in a row")
