"""Preemption: SIGTERM or SIGUSR1 stops every rank after the same step, where the trainer saves and exits with
`PREEMPTED_EXIT_CODE`.

The handler only records the signal: a signal handler that saved, or raised inside a collective, would leave the
ranks at different steps. At each step's end the ranks agree on what they received with one all-reduce (MAX) of the
signal number over a gloo group; it is started at a step's end and read at the next one, so it runs while a step
computes and no step waits for it, and every rank stops after the same step: the one after the signal's. Signals that
arrive later, during the save, are recorded and change nothing: the save finishes and is published whole.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT_CODE", "STOP_SIGNALS", "StopSignals"]

PREEMPTED_EXIT_CODE = 143
"""128 + SIGTERM: what a shell reports for a process that SIGTERM ended, which schedulers read as "stopped from
outside, run it again": Kubernetes' PyTorchJob (ExitCode restart policy) restarts exit codes 128-255, and
scripts/slurm/train.sbatch requeues the job on it after Slurm's warning signal."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""SIGTERM: a scheduler's preemption, `scancel`, Kubernetes, torchrun passing its own on. SIGUSR1: Slurm's
`--signal=USR1@<seconds>` ahead of the time limit."""


class StopSignals:
    """Records SIGTERM / SIGUSR1 from `install` to `restore`; `agreed_signal` at every step's end says whether every
    rank stops now. group: the gloo group of every rank, or None on one rank."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.received: list[int] = []
        self._previous: dict[int, object] = {}
        self._flag = torch.zeros(1, dtype=torch.int64)  # the signal number being agreed on (0: none)
        self._pending: dist.Work | None = None

    def install(self) -> None:
        """From the main thread, before the training loop: until then the signals end the process as usual."""
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def agreed_signal(self) -> int:
        """Every rank at every step's end: the signal all ranks stop on now (the largest received by any rank by the
        previous step's end), or 0. Starts the agreement on what this rank received by now."""
        if self._pending is not None:
            self._pending.wait()
        agreed = int(self._flag.item())
        self._flag = torch.tensor([max(self.received, default=0)], dtype=torch.int64)
        if self.group is not None:
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def finish(self) -> None:
        """At the end of training, every rank: wait for the agreement in flight (all ranks started it)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
