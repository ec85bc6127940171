"""The training loop's side of fault tolerance: one object the loop tells where it is and asks whether to stop, behind
which sit preemption (preemption.py), the hang watchdog (watchdog.py), the straggler check (stragglers.py) and fault
injection (faults.py). How the trainer uses it:

    guard = FaultTolerance(job_config, rank, world_size, metrics, report_error)  # every rank (a gloo group)
    guard.enter("checkpoint"); checkpointer.load()
    batches = guard.timed(iter(dataloader))           # each `next`: the data phase, timed as data wait
    while step < steps:
        guard.begin_step(step)
        train_step(batches)                           # data, then compute
        guard.enter("validation"); validate()         # when it validates
        guard.enter("checkpoint"); checkpointer.save(step)
        if (stop := guard.end_step(step)) and step < steps:
            guard.save_and_stop(stop, step, checkpointer)
            break
    guard.finish()                                    # after the loop, on every rank
    guard.close()                                     # always
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from torchtitan.components.fault_tolerance.faults import FaultInjection
from torchtitan.components.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, StopSignals
from torchtitan.components.fault_tolerance.stragglers import StragglerCheck
from torchtitan.components.fault_tolerance.watchdog import HangWatchdog, PhaseLimits
from torchtitan.config.job_config import JobConfig

__all__ = ["FaultTolerance"]

logger = logging.getLogger(__name__)

_AFTER_THE_STEP = ("validation", "checkpoint", "step_end")  # a step's own time ends where the first of these begins


class FaultTolerance:
    """metrics: where the straggler check's reports go (`MetricsProcessor.log_stragglers`); report: prints a rank's
    one error line and leaves it for the launcher (`launch.report_error`)."""

    def __init__(
        self, job_config: JobConfig, rank: int, world_size: int, metrics: Any, report: Callable[[str], None]
    ) -> None:
        ft, metrics_config = job_config.fault_tolerance, job_config.metrics
        checks_stragglers = metrics_config.straggler_interval > 0 and world_size > 1
        # the agreement and the straggler gather on a gloo group of their own: host tensors, no device sync, and no
        # ordering against the training's collectives (created on every rank: new_group is collective)
        self.group = dist.new_group(backend="gloo") if world_size > 1 and (ft.preemption or checks_stragglers) else None
        self.metrics = metrics
        self.faults = FaultInjection(job_config.debug, rank)
        self.stragglers = None
        if checks_stragglers:
            self.stragglers = StragglerCheck(
                metrics_config.straggler_interval,
                metrics_config.straggler_threshold,
                metrics_config.straggler_warn_after,
                self.group,
                rank,
            )
        self.signals = StopSignals(self.group) if ft.preemption else None
        if self.signals is not None:
            self.signals.install()
        self.watchdog = None
        if ft.hang_timeout_seconds > 0:
            limits = PhaseLimits(ft.hang_timeout_seconds, ft.first_step_timeout_seconds, ft.save_timeout_seconds)
            dump_folder = job_config.job.dump_folder
            self.watchdog = HangWatchdog(limits, _watchdog_store(), rank, world_size, dump_folder, report)
            self.watchdog.start()
        self.step = 0
        self._first_step: int | None = None
        self._step_started: float | None = None
        self._step_seconds = 0.0
        self._data_wait = 0.0

    def enter(self, phase: str) -> None:
        """The loop enters `phase` (hang_report.PHASES) of the current step."""
        if self._step_started is not None and phase in _AFTER_THE_STEP:
            self._step_seconds, self._step_started = time.monotonic() - self._step_started, None
        if self.watchdog is not None:
            self.watchdog.beat(self.step, phase)
        self.faults.at(self.step, phase)

    def timed(self, batches: Iterator) -> Iterator:
        """`batches`, each `next` the data phase, its time (an injected sleep included) this step's data wait."""
        while True:
            start = time.monotonic()
            self.enter("data")
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._data_wait += time.monotonic() - start
            self.enter("compute")
            yield batch

    def begin_step(self, step: int) -> None:
        self.step = step
        if self._first_step is None:
            self._first_step = step
            if self.watchdog is not None:
                self.watchdog.first_step = step
        self._step_started, self._data_wait = time.monotonic(), 0.0
        if self.watchdog is not None:
            self.watchdog.beat(step, "data")

    def end_step(self, step: int) -> str | None:
        """Every rank, at the end of every step: the straggler check when due; the signal every rank agreed to stop
        on now (its name), or None."""
        self.enter("step_end")
        if self.stragglers is not None and step != self._first_step:  # the first holds compile and warm-up
            self.stragglers.add(self._step_seconds, self._data_wait)
            if self.stragglers.due(step):
                self.metrics.log_stragglers(self.stragglers.check(step))
        if self.signals is None:
            return None
        signum = self.signals.agreed_signal()
        return signal.Signals(signum).name if signum else None

    def save_and_stop(self, signal_name: str, step: int, checkpointer: Any) -> None:
        """Every rank agreed to stop after `step` on `signal_name`: save this step's checkpoint synchronously (unless
        this step saved one already) and say so in one line."""
        begin, received = time.monotonic(), len(self.signals.received)
        self.enter("checkpoint")
        if checkpointer.enable and not checkpointer.saves_at(step):
            checkpointer.save(step, preempted=True)
        checkpointer.close()  # a background save of this step: finished and published
        later = len(self.signals.received) - received
        ignored = f" ({later} more signal(s) during the save: recorded, ignored)" if later else ""
        if checkpointer.enable:
            done = (
                f"checkpoint step-{step} saved in {time.monotonic() - begin:.1f} s{ignored}; exiting with code "
                f"{PREEMPTED_EXIT_CODE}: a requeue, or the same command again, resumes from it"
            )
        else:
            done = f"nothing saved (checkpoint.enable is off){ignored}; exiting with code {PREEMPTED_EXIT_CODE}"
        logger.info(f"preempted: every rank stopped after step {step} on {signal_name}; {done}")

    def finish(self) -> None:
        """After the loop (it ran out of steps or stopped), on every rank."""
        if self.signals is not None:
            self.signals.finish()

    def close(self) -> None:
        """Always, last: the watchdog stops and the signals end the process again."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.signals is not None:
            self.signals.restore()


def _watchdog_store() -> dist.Store:
    """A connection of the watchdog's own to the job's store (the main thread never holds it while blocked), its keys
    under a prefix per torchrun attempt (a restart finds no alarm of the previous one)."""
    store = dist.distributed_c10d._get_default_store().clone()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"torchtitan/hang_watchdog/{attempt}/", store)
