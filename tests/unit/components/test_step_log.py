"""StepLog: a step is checked and logged when the next one is added (or at flush), timed by its own marks."""

import pytest
import torch

from torchtitan.components.step_log import StepLog
from torchtitan.tools import async_readback
from torchtitan.tools.async_readback import DeviceMark


class _Metrics:
    log_freq = 1

    def __init__(self):
        self.logged = []

    def log(self, step, **fields):
        self.logged.append((step, fields))


def _add(step_log: StepLog, step: int, loss: float, seconds: float, clock: list[float]) -> None:
    clock.append(0.0)
    started = DeviceMark(torch.device("cpu"))  # at the clock's current time
    clock[-1] = seconds  # the step's values are ready `seconds` later
    step_log.add(step, 1e-3, started, [torch.tensor(loss), torch.tensor(1.0)], graphs_compiled=step)


@pytest.fixture
def clock(monkeypatch):
    times: list[float] = []
    monkeypatch.setattr(async_readback.time, "perf_counter", lambda: times[-1])
    return times


def test_steps_are_logged_one_step_late_or_at_flush(clock):
    metrics = _Metrics()
    step_log = StepLog(metrics, rank=0, total_steps=3, graphs_compiled=0)
    _add(step_log, 1, 5.0, 2.0, clock)
    assert metrics.logged == []  # read only once step 2 is queued
    _add(step_log, 2, 4.0, 0.5, clock)
    assert [step for step, _ in metrics.logged] == [1]
    step_log.flush()
    step_log.flush()  # nothing left: logs nothing twice
    (_, first), (_, second) = metrics.logged
    assert (first["loss"], first["seconds"], first["steps"], first["graphs_compiled"]) == (5.0, 2.0, 1, 1)
    assert (second["loss"], second["seconds"], second["steps"], second["graphs_compiled"]) == (4.0, 0.5, 1, 1)


def test_the_expert_parallel_imbalance_per_layer_is_logged_with_its_step(clock):
    metrics = _Metrics()
    step_log = StepLog(metrics, rank=0, total_steps=2, graphs_compiled=0)
    clock.append(0.0)
    scalars = [torch.tensor(5.0), torch.tensor(1.0), torch.tensor(7.0)]  # loss, grad norm, MTP loss
    step_log.add(1, 1e-3, DeviceMark(torch.device("cpu")), scalars, 0, ep_load_imbalance=torch.tensor([1.5, 1.25]))
    _add(step_log, 2, 4.0, 0.5, clock)  # no imbalance (no EP)
    step_log.flush()
    (_, first), (_, second) = metrics.logged
    assert (first["loss"], first["grad_norm"], first["mtp_loss"]) == (5.0, 1.0, 7.0)
    assert first["ep_load_imbalance"] == [1.5, 1.25]
    assert second["ep_load_imbalance"] is None and second["mtp_loss"] is None


def test_the_dropped_share_is_the_mean_of_the_window_and_comes_before_the_imbalance(clock):
    metrics = _Metrics()
    metrics.log_freq = 2
    step_log = StepLog(metrics, rank=0, total_steps=4, graphs_compiled=0)
    for step, dropped in enumerate((0.1, 0.3, 0.0, 0.0), start=1):
        clock.append(0.0)
        scalars = [torch.tensor(5.0), torch.tensor(1.0)]
        imbalance = torch.tensor([1.5, 1.25])
        step_log.add(step, 1e-3, DeviceMark(torch.device("cpu")), scalars, 0, imbalance, torch.tensor(dropped))
    step_log.flush()
    (_, first), (_, second) = metrics.logged
    assert first["dropped_fraction"] == pytest.approx(0.2) and second["dropped_fraction"] == 0.0
    assert first["ep_load_imbalance"] == [1.5, 1.25] and first["loss"] == 5.0


def test_a_window_counts_the_steps_this_run_took(clock):
    # resumed after step 5 with log_freq 10: the first window holds steps 6..10 only
    metrics = _Metrics()
    metrics.log_freq = 10
    step_log = StepLog(metrics, rank=0, total_steps=12, graphs_compiled=0)
    for step in range(6, 11):
        _add(step_log, step, 3.0, 1.0, clock)
    step_log.flush()
    ((step, fields),) = metrics.logged
    assert (step, fields["steps"], fields["seconds"]) == (10, 5, 5.0)


def test_a_diverged_step_stops_training_when_it_is_read(clock):
    step_log = StepLog(_Metrics(), rank=0, total_steps=3, graphs_compiled=0)
    _add(step_log, 1, float("nan"), 1.0, clock)
    with pytest.raises(FloatingPointError, match="non-finite loss at step 1 on rank 0"):
        _add(step_log, 2, 4.0, 1.0, clock)


def test_adams_update_rms_is_logged_per_group_without_the_groups_it_does_not_step(clock):
    metrics = _Metrics()
    step_log = StepLog(metrics, rank=0, total_steps=1, graphs_compiled=0)
    clock.append(0.0)
    rms = torch.tensor([0.5, float("nan"), 0.25, 1.0, float("nan"), 0.75])  # one per PARAMETER_GROUPS
    scalars = [torch.tensor(5.0), torch.tensor(1.0)]
    step_log.add(1, 1e-3, DeviceMark(torch.device("cpu")), scalars, 0, ep_load_imbalance=torch.tensor([1.5]),
                 dropped_fraction=torch.tensor(0.125), update_rms=rms)  # fmt: skip
    step_log.flush()
    ((_, fields),) = metrics.logged
    assert fields["update_rms"] == {"matrices": 0.5, "embeddings": 0.25, "head": 1.0, "norms_and_biases": 0.75}
    assert fields["ep_load_imbalance"] == [1.5] and fields["dropped_fraction"] == 0.125
