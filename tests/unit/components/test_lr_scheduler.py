import logging
import math

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig

PEAK = 1.0


def make(steps=10, warmup=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0, parts=1):
    config = JobConfig()
    config.training.steps = steps
    config.optimizer.lr = PEAK
    config.optimizer.implementation = "for-loop"
    config.lr_scheduler.warmup_steps = warmup
    config.lr_scheduler.decay_ratio = decay_ratio
    config.lr_scheduler.decay_type = decay_type
    config.lr_scheduler.min_lr_factor = min_lr_factor
    model_parts = [torch.nn.Linear(2, 2) for _ in range(parts)]
    optimizers = build_optimizers(model_parts, config)
    return optimizers, build_lr_schedulers(optimizers, config)


def lrs_used_by_steps(steps, **kwargs):
    """The lr each optimizer step 1..steps runs with (read before the step, like the trainer)."""
    optimizers, schedulers = make(steps=steps, **kwargs)
    used = []
    for _ in range(steps):
        used.append(optimizers.optimizers[0].param_groups[0]["lr"])
        optimizers.step()
        schedulers.step()
    return used, schedulers


def test_linear_warmup_then_linear_decay_to_zero():
    used, schedulers = lrs_used_by_steps(10, warmup=2)
    # warmup: (s+1)/(W+1); decay over D=8 steps: 1 - (s+1-W)/(D+1)
    expected = [1 / 3, 2 / 3] + [1 - k / 9 for k in range(1, 9)]
    assert used == pytest.approx(expected)
    assert schedulers.get_last_lr() == pytest.approx(0.0)  # clamped past the end: exactly min


@pytest.mark.parametrize(
    ("decay_type", "shape"),
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_warmup_stable_decay_shapes_with_min_lr(decay_type, shape):
    # 20 steps, 4 warmup, decay_ratio 0.25 -> D=5 decay steps, S=11 stable steps.
    used, _ = lrs_used_by_steps(20, warmup=4, decay_ratio=0.25, decay_type=decay_type, min_lr_factor=0.1)
    assert used[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert used[4:15] == pytest.approx([1.0] * 11)
    decay = [0.1 + 0.9 * shape(k / 6) for k in range(1, 6)]
    assert used[15:] == pytest.approx(decay)
    assert min(used) > 0.1  # never below min_lr_factor


def test_key_values_cosine_midpoint():
    # 1 warmup step then D=9: at the middle of the decay (p = 5/10) cosine gives exactly 0.5.
    used, _ = lrs_used_by_steps(10, warmup=1, decay_type="cosine")
    assert used[0] == pytest.approx(0.5)
    assert used[5] == pytest.approx(0.5)


def test_no_warmup_starts_at_peak_decay():
    used, _ = lrs_used_by_steps(4, warmup=0)
    assert used == pytest.approx([1 - 1 / 5, 1 - 2 / 5, 1 - 3 / 5, 1 - 4 / 5])


def test_all_optimizers_of_all_parts_follow_the_schedule():
    optimizers, schedulers = make(parts=3)
    for _ in range(3):
        optimizers.step()
        schedulers.step()
    lrs = {opt.param_groups[0]["lr"] for opt in optimizers}
    assert len(lrs) == 1 and lrs.pop() == pytest.approx(schedulers.get_last_lr())


def test_state_dict_round_trip_restores_step_and_lr():
    optimizers, schedulers = make(steps=10, warmup=2)
    for _ in range(5):
        optimizers.step()
        schedulers.step()
    state = schedulers.state_dict()
    assert state == {"last_epoch": 5}

    fresh_opt, fresh = make(steps=10, warmup=2, parts=2)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())
    assert all(o.param_groups[0]["lr"] == pytest.approx(schedulers.get_last_lr()) for o in fresh_opt)
    fresh_opt.step()
    fresh.step()
    optimizers.step()
    schedulers.step()
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())


def test_short_runs_clamp_warmup_and_decay_to_the_steps():
    # warmup 6 > 5 steps: warm up over all 5 steps, the lr rises every step and never decays.
    used, _ = lrs_used_by_steps(5, warmup=6)
    assert used == sorted(used) and used[-1] < PEAK
    # warmup 5 + decay 8 > 10 steps: decay over the last 5 steps down to min_lr_factor * PEAK = 0.
    used, schedulers = lrs_used_by_steps(10, warmup=5, decay_ratio=0.8)
    assert used[:5] == sorted(used[:5]) and used[5:] == sorted(used[5:], reverse=True)
    assert max(used) > 0.8 * PEAK  # torchtitan-style ramps: (s+1)/(W+1) up, then down from there


@pytest.mark.parametrize(
    ("steps", "warmup", "decay_ratio", "line"),
    [
        (50, 100, 0.8, "lr schedule of this 50-step run: warming up over all 50 steps, no decay "
                       "(lr_scheduler.warmup_steps=100 is longer than the run)"),
        (5, 2, 0.8, "lr schedule of this 5-step run: warmup 2, then decaying over the last 3 steps (the 4 of "
                    "lr_scheduler.decay_ratio=0.8 do not fit beside the warmup)"),
        (30, 2, 0.8, None),  # the debug model's schedule fits the quick start's 30 steps
    ],
    ids=["warmup-longer-than-the-run", "decay-shortened", "fits"],
)  # fmt: skip
def test_a_run_shorter_than_its_schedule_is_one_info_line_not_a_warning(caplog, steps, warmup, decay_ratio, line):
    """Every short run warned, twice where the warmup took it all (the second: 'decaying over the last 0 steps'):
    compressing the schedule is what a smoke test or benchmark wants, as in torchtitan."""
    with caplog.at_level(logging.INFO, logger="torchtitan.components.lr_scheduler"):
        make(steps=steps, warmup=warmup, decay_ratio=decay_ratio)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "torchtitan.components.lr_scheduler"]
    assert records == ([(logging.INFO, line)] if line else [])
