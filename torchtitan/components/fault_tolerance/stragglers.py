"""Stragglers: every `metrics.straggler_interval` steps, each rank's mean step time and data wait over those steps in
one all-gather, the slowest rank and its ratio to the median into the metrics, a warning when one rank stays over
`metrics.straggler_threshold`.

In synchronous training every rank's wall time per step is the same: the ranks wait for each other inside the step's
collectives. What tells a slow rank apart is the time it spends before it joins them, where the others wait for it;
measured here: its data wait. A rank's own time is its step time less the time it waited for the slowest rank's data:

    own[r] = step[r] - (max(data_wait) - data_wait[r])

so the rank whose loader is slow keeps its whole step time and the others' drops by what they waited for it. A rank
slowed on its device (a throttled GPU, a slow link) makes every rank wait inside the collectives, which no host timer
tells apart: the profiler's per-rank traces and the flight recorder show those.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StragglerCheck", "StragglerReport", "own_step_seconds"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerReport:
    step: int
    slowest_rank: int
    ratio: float
    """The slowest rank's own step time over the median rank's."""
    median_step_seconds: float
    """The median of the ranks' own step times."""
    slowest_data_wait_seconds: float
    """The slowest rank's data wait per step."""

    def record(self) -> dict[str, float | int]:
        """Its metrics.jsonl / TensorBoard / W&B values."""
        return {
            "straggler/slowest_rank": self.slowest_rank,
            "straggler/ratio": self.ratio,
            "straggler/median_step_seconds": self.median_step_seconds,
            "straggler/slowest_data_wait_seconds": self.slowest_data_wait_seconds,
        }


def own_step_seconds(step_seconds: list[float], data_wait_seconds: list[float]) -> list[float]:
    """Each rank's step time less what it waited for the slowest rank's data (module docstring)."""
    slowest_data = max(data_wait_seconds)
    return [max(step - (slowest_data - data), 0.0) for step, data in zip(step_seconds, data_wait_seconds, strict=True)]


class StragglerCheck:
    """`add` every step's times; `check` on the steps `due` (every rank: one all-gather over `group`)."""

    def __init__(self, interval: int, threshold: float, warn_after: int, group: dist.ProcessGroup, rank: int) -> None:
        self.interval = interval
        self.threshold = threshold
        self.warn_after = warn_after
        self.group = group
        self.rank = rank
        self._seconds = [0.0, 0.0]  # step, data wait: summed over the window
        self._steps = 0
        self._streak: tuple[int, int] = (-1, 0)  # (rank over the threshold, consecutive checks)

    def add(self, step_seconds: float, data_wait_seconds: float) -> None:
        self._seconds[0] += step_seconds
        self._seconds[1] += data_wait_seconds
        self._steps += 1

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and self._steps > 0

    def check(self, step: int) -> StragglerReport:
        """Gathers every rank's window, resets it; warns (rank 0) when one rank was over the threshold at
        `warn_after` checks in a row."""
        mine = torch.tensor(self._seconds, dtype=torch.float64) / self._steps
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, mine, group=self.group)
        self._seconds, self._steps = [0.0, 0.0], 0
        step_seconds = [float(t[0]) for t in gathered]
        data_wait = [float(t[1]) for t in gathered]
        own = own_step_seconds(step_seconds, data_wait)
        slowest = max(range(len(own)), key=own.__getitem__)
        median = statistics.median(own)
        ratio = own[slowest] / median if median > 0 else 1.0
        report = StragglerReport(step, slowest, ratio, median, data_wait[slowest])
        self._warn_if_persistent(report)
        return report

    def _warn_if_persistent(self, report: StragglerReport) -> None:
        if report.ratio <= self.threshold:
            self._streak = (-1, 0)
            return
        rank, count = self._streak
        self._streak = (report.slowest_rank, count + 1 if rank == report.slowest_rank else 1)
        if self._streak[1] == self.warn_after and self.rank == 0:
            logger.warning(
                f"straggler: rank {report.slowest_rank} has been the slowest for {self.warn_after} checks in a row "
                f"(every {self.interval} steps, up to step {report.step}): its own step time is {report.ratio:.2f}x "
                f"the median rank's {report.median_step_seconds:.3f} s (metrics.straggler_threshold {self.threshold:g}"
                f"), with a data wait of {report.slowest_data_wait_seconds:.3f} s a step; look at that rank's host: "
                "its data loading, its disk or network, other processes on it"
            )
