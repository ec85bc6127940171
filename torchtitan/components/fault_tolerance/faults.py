"""Fault injection for the tests of preemption, the watchdog and the straggler check (`--debug.sleep_*`,
`--debug.sigterm_*`): a chosen rank sleeps, or signals itself, when it enters a chosen phase of a chosen step."""

from __future__ import annotations

import logging
import os
import signal
import time

from torchtitan.config import ConfigError
from torchtitan.config.job_config import Debug

__all__ = ["FaultInjection", "check_fault_ranks"]

logger = logging.getLogger(__name__)


class FaultInjection:
    def __init__(self, debug: Debug, rank: int) -> None:
        self.debug = debug
        self.sleeps = debug.sleep_seconds > 0 and rank == debug.sleep_rank
        self.signals = debug.sigterm_at_step > 0 and debug.sigterm_rank in (-1, rank)
        self.rank = rank
        self._done: set[tuple[str, int]] = set()  # (fault, step): once per step (a step loads several micro-batches)

    def at(self, step: int, phase: str) -> None:
        """Entering `phase` of `step`: sleep or send SIGTERM to itself if asked to here."""
        debug = self.debug
        if self.sleeps and phase == debug.sleep_phase and self._sleeps_at(step) and self._first("sleep", step):
            if step == debug.sleep_at_step:
                every = " and at every later step" if debug.sleep_every_step else ""
                logger.warning(
                    f"debug: rank {self.rank} sleeps {debug.sleep_seconds:g} s at step {step} ({phase}){every}"
                )
            time.sleep(debug.sleep_seconds)
        kills = self.signals and step == debug.sigterm_at_step and phase == debug.sigterm_phase
        if kills and self._first("kill", step):
            logger.warning(f"debug: rank {self.rank} sends itself SIGTERM at step {step} ({phase})")
            os.kill(os.getpid(), signal.SIGTERM)

    def _sleeps_at(self, step: int) -> bool:
        at = self.debug.sleep_at_step
        return step == at or (self.debug.sleep_every_step and step > at)

    def _first(self, fault: str, step: int) -> bool:
        if (fault, step) in self._done:
            return False
        self._done.add((fault, step))
        return True


def check_fault_ranks(debug: Debug, world_size: int) -> None:
    """Preflight: a fault aimed at a rank the job does not have would never happen."""
    for name, rank, on in (
        ("sleep_rank", debug.sleep_rank, debug.sleep_seconds > 0),
        ("sigterm_rank", debug.sigterm_rank, debug.sigterm_at_step > 0),
    ):
        if on and rank >= world_size:
            raise ConfigError(
                f"debug.{name}={rank}, but the job has {world_size} ranks (0-{world_size - 1}); pass one of those"
                + (" or -1 for every rank" if name == "sigterm_rank" else "")
            )
