"""A hang names its rank: a daemon thread per rank watches the training loop's heartbeat.

The loop says where it is (`beat(step, phase)`: one tuple stored, no I/O). When this rank's heartbeat is older than
its phase's limit, or another rank raised the alarm in the c10d store (over a connection of the thread's own, which
answers while the main thread blocks in a collective), the thread writes where this rank is into
`<dump_folder>/hangs/<time>/`:

    rank<N>.txt                     step, phase, and every thread's Python stack (faulthandler)
    rank<N>.flight_recorder.json    torch's record of this rank's last collectives, the pending ones among them
    rank<N>.nccl_trace.pkl          on CUDA builds: NCCL's flight recorder (torch.distributed.flight_recorder reads it)

and a short record of it into the store. Rank 0, or the first other rank to claim it should rank 0 not answer, prints
the one line of `hang_report.hang_line` naming the ranks the others wait for; every rank leaves that line for the
launcher and exits with HANG_EXIT_CODE through os._exit (its main thread is stuck).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.fault_tolerance.hang_report import hang_line
from torchtitan.tools.error_file import leave_error_line

__all__ = ["HANG_EXIT_CODE", "HangWatchdog", "PhaseLimits", "enable_flight_recorder"]

HANG_EXIT_CODE = 124
"""As `timeout(1)`'s: the command ran past its limit. torchrun restarts the ranks on any non-zero code (with
--max-restarts), and they resume from the last checkpoint."""

HANG_FOLDER = "hangs"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))).replace(
    os.sep, "/"
)
FLIGHT_RECORDER_ENTRIES = "2000"


def enable_flight_recorder() -> None:
    """Before the process groups exist: torch keeps each rank's last collectives (gloo's and NCCL's) in a ring buffer,
    which a hang's dump writes out. A value the user set is kept."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # its older name, which torch still reads
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


@dataclass(frozen=True)
class PhaseLimits:
    """Seconds a rank may stay in one phase (fault_tolerance.*_timeout_seconds)."""

    step: float
    first_step: float
    save: float

    def of(self, phase: str, first_step: bool) -> float:
        if phase == "checkpoint":
            return self.save
        if first_step or phase == "validation":
            return self.first_step
        return self.step


class HangWatchdog:
    """`start`, then `beat` at every phase; `stop` before the process groups go.

    store: a store every rank reaches (a `PrefixStore` of its own); report: prints the line and leaves it for the
    launcher (`launch.report_error`); exit: os._exit, replaced in tests."""

    def __init__(
        self,
        limits: PhaseLimits,
        store: dist.Store,
        rank: int,
        world_size: int,
        dump_folder: str,
        report: Callable[[str], None],
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.limits = limits
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.dump_folder = dump_folder
        self.report = report
        self.exit = exit
        self.first_step = 1  # the first step this process trains (compile): `limits.first_step`
        self._heartbeat = (0, "checkpoint", time.monotonic())
        self._poll = min(5.0, max(0.1, min(limits.step, limits.first_step, limits.save) / 10))
        self._grace = max(2.0, 3 * self._poll)  # how long the ranks wait for each other's records
        self._main_thread = threading.main_thread().ident
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * self._poll)

    def beat(self, step: int, phase: str) -> None:
        self._heartbeat = (step, phase, time.monotonic())

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            step, phase, since = self._heartbeat
            stalled = time.monotonic() - since
            alarm = stalled > self.limits.of(phase, step <= self.first_step)
            if not alarm:
                try:
                    alarm = self.store.check(["hang"])
                except Exception:  # the store's host is gone: the job is ending anyway
                    continue
            if alarm and not self._stopped.is_set():
                self._on_hang(step, phase, stalled)
                return

    def _on_hang(self, step: int, phase: str, stalled: float) -> None:
        try:
            hang_id = self.store.compare_set("hang", "", time.strftime("%Y%m%d-%H%M%S")).decode()
            folder = os.path.join(self.dump_folder, HANG_FOLDER, hang_id)
            self.store.set(f"record/{self.rank}", json.dumps(self._dump(folder, step, phase, stalled)))
            self._agree_on_line(folder)
        except Exception as err:  # the other ranks cannot be asked: what this rank knows
            self.report(
                f"error: training hung: rank {self.rank} made no progress for {stalled:.0f} s at step {step} "
                f"({phase}); the other ranks could not be asked ({type(err).__name__}: {err}); exiting with code "
                f"{HANG_EXIT_CODE}"
            )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self.exit(HANG_EXIT_CODE)

    def _agree_on_line(self, folder: str) -> None:
        """Rank 0 (or the first rank to claim it, should rank 0 not answer) reports the line once every rank's record
        is in or the grace is over; every rank leaves it for the launcher."""
        everyone = [f"record/{rank}" for rank in range(self.world_size)]
        self._wait_for(everyone, self._grace)
        if self.rank != 0 and self._wait_for(["summary"], self._grace):
            self._take_line()
            return
        if self.store.add("reporter", 1) == 1:
            records = {
                rank: json.loads(self.store.get(key)) for rank, key in enumerate(everyone) if self.store.check([key])
            }
            line = hang_line(records, self.world_size, folder, HANG_EXIT_CODE)
            self.report(line)  # before the others may exit: a launcher stops the rest once one rank is gone
            self.store.set("summary", line)
            # the store may live in this process (a job started without torchrun): leave once the others have the line
            deadline = time.monotonic() + self._grace
            while self.store.add("summary_taken", 0) < len(records) - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        elif self._wait_for(["summary"], self._grace):
            self._take_line()

    def _take_line(self) -> None:
        leave_error_line(self.store.get("summary").decode())
        self.store.add("summary_taken", 1)

    def _wait_for(self, keys: list[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _dump(self, folder: str, step: int, phase: str, stalled: float) -> dict[str, Any]:
        """Writes this rank's stacks and flight recorder into `folder`; returns its record (hang_report.py)."""
        where, in_collective = innermost_frame(sys._current_frames().get(self._main_thread))
        record = {
            "step": step,
            "phase": phase,
            "stalled_seconds": round(stalled, 1),
            "where": where,
            "in_collective": in_collective,
            "collectives": {},
        }
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"rank{self.rank}.txt"), "w") as f:
                f.write(
                    f"rank {self.rank}: step {step}, phase {phase}, no progress for {stalled:.1f} s\n"
                    f"main thread at: {where}\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            record["collectives"] = self._dump_flight_recorder(folder)
        except OSError as err:  # a full or read-only disk: the line still names the ranks
            record["where"] += f" (no dump: {err})"
        return record

    def _dump_flight_recorder(self, folder: str) -> dict[str, int]:
        """Each flight recorder torch has (gloo's and the generic one; NCCL's on CUDA builds) into `folder`; returns
        {recorder:group -> collectives enqueued}."""
        c10d = torch._C._distributed_c10d
        enqueued: dict[str, int] = {}
        for recorder, suffix in (("fr", "flight_recorder"), ("nccl", "nccl_trace")):
            dump_json = getattr(c10d, f"_dump_{recorder}_trace_json", None)
            if dump_json is None:
                continue
            try:
                trace = json.loads(dump_json(True, False))  # every collective, not only the pending ones
            except Exception:  # recorder off (no buffer) or not built in: nothing to add
                continue
            with open(os.path.join(folder, f"rank{self.rank}.{suffix}.json"), "w") as f:
                json.dump(trace, f)
            for group, status in trace.get("pg_status", {}).items():
                enqueued[f"{recorder}:{group}"] = int(status.get("last_enqueued_collective", -1))
        if (dump_pickle := getattr(c10d, "_dump_nccl_trace", None)) is not None:
            try:
                with open(os.path.join(folder, f"rank{self.rank}.nccl_trace.pkl"), "wb") as f:
                    f.write(dump_pickle())
            except Exception:
                pass
        return enqueued


def innermost_frame(frame: FrameType | None) -> tuple[str, bool]:
    """("file:line in function", whether it is torch.distributed's: waiting for other ranks) of a thread's frame; the
    file relative to site-packages or to this checkout."""
    if frame is None:
        return "an unknown frame", False
    path = frame.f_code.co_filename.replace(os.sep, "/")
    short = path.split("/site-packages/")[-1]
    if short == path and path.startswith(_CHECKOUT + "/"):
        short = path[len(_CHECKOUT) + 1 :]
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}", "torch/distributed/" in short
