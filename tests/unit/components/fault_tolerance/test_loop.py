"""The training loop's guard on one rank: the signals handled only with preemption on and only while it lives; a
stop saves the step it stopped at unless that step saved already, and says so in one line."""

import logging
import os
import signal

import pytest

from torchtitan.components.fault_tolerance import FaultTolerance
from torchtitan.config import ConfigManager


def guard(*flags: str) -> FaultTolerance:
    job_config = ConfigManager().parse_args(["--fault_tolerance.hang_timeout_seconds", "0", *flags])
    return FaultTolerance(job_config, rank=0, world_size=1, metrics=None, report=print)


def test_the_signals_are_handled_with_preemption_on_and_only_until_close():
    before = signal.getsignal(signal.SIGTERM)
    off = guard("--fault_tolerance.preemption=false")
    assert signal.getsignal(signal.SIGTERM) == before  # off: SIGTERM ends the process as usual
    off.close()
    on = guard()
    assert signal.getsignal(signal.SIGTERM) != before
    on.close()
    assert signal.getsignal(signal.SIGTERM) == before


class FakeCheckpointer:
    def __init__(self, interval: int) -> None:
        self.enable, self.interval, self.saved = True, interval, []

    def saves_at(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, preempted: bool = False) -> None:
        self.saved.append((step, preempted))
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal, during the save

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("interval", "saved"), [(100, [(3, True)]), (3, [])])
def test_a_stop_saves_its_step_unless_it_saved_already(caplog, interval, saved):
    ft = guard()
    checkpointer = FakeCheckpointer(interval)
    try:
        for step in (1, 2, 3):
            ft.begin_step(step)
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            stop = ft.end_step(step)
        assert stop == "SIGTERM"  # agreed at the end of the step after the signal's
        with caplog.at_level(logging.INFO):
            ft.save_and_stop(stop, 3, checkpointer)
        ft.finish()
    finally:
        ft.close()
    assert checkpointer.saved == saved
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("preempted: every rank stopped after step 3 on SIGTERM; checkpoint step-3 saved in ")
    assert ("(1 more signal(s) during the save: recorded, ignored)" in line) == bool(saved)
    assert line.endswith("exiting with code 143: a requeue, or the same command again, resumes from it")
