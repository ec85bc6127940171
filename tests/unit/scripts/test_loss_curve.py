"""scripts/bench/loss_curve.py: end-loss gaps and the largest gap over windows of steps."""

import pytest

from scripts.bench.loss_curve import end_gaps, step_gaps, window_gaps


def test_window_gaps_take_the_largest_window_mean_gap_over_complete_windows():
    reference = [4.0] * 10
    # windows of 4 steps: [0:4] equal, [4:8] mean 4.1 (+2.5%), steps 8-9 a partial window, left out
    other = [4.0] * 4 + [4.2, 4.0, 4.2, 4.0] + [9.0, 9.0]
    gaps = window_gaps({"reference": reference, "other": other}, window=4)
    assert gaps["reference"] == 0.0
    assert gaps["other"] == pytest.approx(0.025)


def test_end_gaps_average_the_last_steps():
    gaps = end_gaps({"reference": [5.0, 2.0, 2.0], "other": [5.0, 2.0, 2.2]}, last=2)
    assert gaps["other"]["end_loss"] == pytest.approx(2.1)
    assert gaps["other"]["relative_gap"] == pytest.approx(0.05)


def test_step_gaps_count_only_the_steps_after_the_given_one():
    reference = [10.0, 4.0, 4.0, 4.0]
    other = [20.0, 4.0, 4.1, 4.0, 7.0]  # step 1 (+100%) is before the check; step 5 has no reference step
    gaps = step_gaps({"reference": reference, "other": other}, after=1)
    assert gaps["reference"] == 0.0
    assert gaps["other"] == pytest.approx(0.025)
