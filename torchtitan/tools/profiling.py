"""`[profiling]`: torch.profiler traces and CUDA memory snapshots of chosen training steps.

Every `profile_freq` steps of this run the profiler records one step after three warm-up steps and writes, per rank,
under `<dump_folder>/<save_traces_folder>/iteration_<step>/`:
    rank<R>_trace.json         Chrome/Perfetto trace (with input shapes; scripts/bench/trace_breakdown.py reads it)
    rank<R>_summary.json       per recorded step: the kernels launched inside it by device time, the host's waits
With `enable_memory_snapshot` (CUDA only) the allocator history is recorded from the start and dumped at the same
steps to `<dump_folder>/memory_snapshot/iteration_<step>/rank<R>_memory_snapshot.pickle` (pytorch.org/memory_viz,
scripts/bench/memory_breakdown.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

logger = logging.getLogger(__name__)

__all__ = ["MIN_PROFILE_FREQ", "ProfiledStep", "StepProfiler", "profiled_steps", "step_summary"]

_WARMUP_STEPS = 3
_ACTIVE_STEPS = 1
MIN_PROFILE_FREQ = _WARMUP_STEPS + _ACTIVE_STEPS
_SNAPSHOT_ENTRIES = 1_000_000


class StepProfiler:
    """Call `step(training_step)` after every training step and `close()` at the end (or use `with`).
    host_waiting_ops: names of ops whose host time waits for the device (the exchange backend's), summed in the
    summary's host waits."""

    def __init__(
        self, config, dump_folder: str, rank: int, device: torch.device, host_waiting_ops: Collection[str] = ()
    ) -> None:
        self.rank = rank
        self.host_waiting_ops = tuple(sorted(host_waiting_ops))
        self.freq = config.profile_freq
        self.trace_dir = Path(dump_folder) / config.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / "memory_snapshot"
        self._profiler = None
        self._snapshot = config.enable_memory_snapshot
        self._steps_run = 0
        self._training_step = 0
        if config.enable_profiling:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            wait = self.freq - _WARMUP_STEPS - _ACTIVE_STEPS
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=wait, warmup=_WARMUP_STEPS, active=_ACTIVE_STEPS),
                on_trace_ready=self._write_trace,
                record_shapes=True,  # the ops' shapes give trace_breakdown.py their FLOPs and bytes
            )
            self._profiler.start()
            logger.info(f"profiling step {self.freq} and every {self.freq} steps after it into {self.trace_dir}")
        self._exit_stack = contextlib.ExitStack()
        if self._snapshot:
            # Recording stacks inside a checkpoint that stops its recompute early loses an exception
            # (pytorch/pytorch#179536); until that is fixed, recompute whole regions while recording.
            self._exit_stack.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))
            # Python stacks only (C++ unwinding slows every allocation); enough entries for a few compiled steps.
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=_SNAPSHOT_ENTRIES)

    def step(self, training_step: int) -> None:
        self._steps_run += 1
        self._training_step = training_step
        if self._profiler is not None:
            self._profiler.step()
        if self._snapshot and self._steps_run % self.freq == 0:
            folder = self.snapshot_dir / f"iteration_{training_step}"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot = False
        self._exit_stack.close()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_trace(self, prof: profile) -> None:
        folder = self.trace_dir / f"iteration_{self._training_step}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(trace))
        # torch numbers the steps it records from 0 at the profiler's start: name them by training step instead
        offset = self._training_step - self._steps_run + 1
        text = _STEP_LABEL.sub(lambda m: f'"ProfilerStep#{int(m.group(1)) + offset}"', trace.read_text())
        trace.write_text(text)
        summary = {
            "step": self._training_step,
            "rank": self.rank,
            **step_summary(json.loads(text), host_waiting_ops=self.host_waiting_ops),
        }
        (folder / f"rank{self.rank}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        logger.info(f"profiler trace of step {self._training_step} written to {folder}")


_STEP_LABEL = re.compile(r'"ProfilerStep#(\d+)"')

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of the work a device runs; `args.correlation` names the runtime call that launched it."""
RUNTIME_CALLS = ("cuda_runtime", "cuda_driver")


@dataclass
class ProfiledStep:
    """One `ProfilerStep#<n>` of a trace: its host time range and what was launched inside it."""

    name: str
    start_us: float
    end_us: float
    runtime_calls: list[dict] = field(default_factory=list)  # CUDA runtime/driver calls, any host thread
    device_events: list[dict] = field(default_factory=list)  # the kernels, copies and memsets those calls launched

    def holds(self, event: dict) -> bool:
        return self.start_us <= event["ts"] <= self.end_us

    def blocking_calls(self) -> list[dict]:
        """The step's CUDA calls that held the host until the device got there (`HOST_BLOCKING_CALLS`)."""
        return [call for call in self.runtime_calls if call["name"] in HOST_BLOCKING_CALLS]


def profiled_steps(trace: dict) -> tuple[list[ProfiledStep], list[dict]]:
    """The recorded steps of a chrome trace (`export_chrome_trace`), each with the device events launched inside its
    host range (wherever they ran on the device), and the device events launched outside every step (mostly still
    queued from before the recording started: their launches are not in the trace)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = {
        e["name"]: ProfiledStep(e["name"], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") in ("user_annotation", "cpu_op")
    }
    launched_in = {}  # correlation id (of calls that have one) -> the step whose range holds the launch
    for event in events:
        if event.get("cat") in RUNTIME_CALLS:
            step = next((s for s in steps.values() if s.holds(event)), None)
            if step is not None and "correlation" in event.get("args", {}):
                step.runtime_calls.append(event)
                launched_in[event["args"]["correlation"]] = step
    outside = []
    for event in events:
        if event.get("cat") in DEVICE_EVENTS:
            step = launched_in.get(event.get("args", {}).get("correlation"))
            (outside if step is None else step.device_events).append(event)
    return sorted(steps.values(), key=lambda s: s.start_us), outside


HOST_BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that hold the host until the GPU gets there (`cudaMemcpy` without Async: pageable copies)."""


def step_summary(trace: dict, top: int = 40, host_waiting_ops: Collection[str] = ()) -> dict:
    """Per recorded step: its host time, the device time of the kernels (copies, memsets) launched inside it and the
    `top` of them, and the host's waits: the blocking CUDA calls, and the CPU time of each of `host_waiting_ops`
    (ops whose host time waits for the device, e.g. DeepEP's dispatch for the received counts; the exchange backend
    names them). Device times of several streams add up."""
    steps, outside = profiled_steps(trace)
    waiting = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") in host_waiting_ops]
    summaries = []
    for step in steps:
        kernels, blocking = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])  # name -> [ms, count]
        for totals, events in ((kernels, step.device_events), (blocking, step.blocking_calls())):
            for event in events:
                totals[event["name"]][0] += event["dur"] / 1e3
                totals[event["name"]][1] += 1
        device_ms = sum(ms for ms, _ in kernels.values())
        summaries.append(
            {
                "name": step.name,
                "host_ms": (step.end_us - step.start_us) / 1e3,
                "device_ms": device_ms,
                "kernels": [
                    {"name": name[:160], "ms": ms, "launches": n, "pct": 100.0 * ms / device_ms}
                    for name, (ms, n) in sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
                ],
                "host_blocked": {
                    "blocking_calls": {name: {"ms": ms, "calls": n} for name, (ms, n) in blocking.items()},
                    "blocking_ms": sum(ms for ms, _ in blocking.values()),
                    "waiting_ops_cpu_ms": {
                        name: sum(e["dur"] for e in waiting if e["name"] == name and step.holds(e)) / 1e3
                        for name in host_waiting_ops
                    },
                },
            }
        )
    return {"device_ms_launched_outside_steps": sum(e["dur"] for e in outside) / 1e3, "profiler_steps": summaries}
