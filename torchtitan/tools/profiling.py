"""`[profiling]`: torch.profiler traces and CUDA memory snapshots of chosen training steps.

Every `profile_freq` steps of this run (counted from its first step, also after a resume) the profiler records one
step after three warm-up steps and writes, per rank, under `<dump_folder>/<save_traces_folder>/iteration_<step>/`
(<step> is the training step):
    rank<R>_trace.json         Chrome/Perfetto trace
    rank<R>_summary.json       ops and kernels by self device time (what the benchmarks quote)
With `enable_memory_snapshot` (CUDA only) the allocator history is recorded from the start and dumped at the
same steps to `<dump_folder>/memory_snapshot/iteration_<step>/rank<R>_memory_snapshot.pickle`
(open it at pytorch.org/memory_viz, or summarise it with scripts/bench/memory_breakdown.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

logger = logging.getLogger(__name__)

__all__ = ["MIN_PROFILE_FREQ", "StepProfiler", "kernel_summary"]

_WARMUP_STEPS = 3
_ACTIVE_STEPS = 1
MIN_PROFILE_FREQ = _WARMUP_STEPS + _ACTIVE_STEPS
_SNAPSHOT_ENTRIES = 1_000_000


class StepProfiler:
    """Call `step(training_step)` after every training step and `close()` at the end (or use `with`)."""

    def __init__(self, config, dump_folder: str, rank: int, device: torch.device) -> None:
        self.rank = rank
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
            )
            self._profiler.start()
            logger.info(f"profiling step {self.freq} and every {self.freq} steps after it into {self.trace_dir}")
        self._exit_stack = contextlib.ExitStack()
        if self._snapshot:
            # torch 2.11 loses an exception while recording stacks inside a checkpointed compiled region when the
            # checkpoint stops its recompute early (pytorch/pytorch#179536: "apply ... returned NULL without
            # setting an exception"); recompute the whole region instead while recording.
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
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        summary = {
            "step": self._training_step,
            "rank": self.rank,
            "ops": kernel_summary(prof, steps=_ACTIVE_STEPS),
            "host_blocked": host_blocked_summary(prof, steps=_ACTIVE_STEPS),
        }
        (folder / f"rank{self.rank}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        logger.info(f"profiler trace of step {self._training_step} written to {folder}")


def kernel_summary(prof: profile, steps: int = 1, top: int = 40) -> list[dict]:
    """The `top` ops/kernels by self device time (self CPU time on a CPU-only trace), per profiled step."""
    events = list(prof.key_averages())
    on_device = any(e.self_device_time_total > 0 for e in events)

    def self_us(e) -> float:
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    events = [e for e in events if self_us(e) > 0]
    total = sum(self_us(e) for e in events) or 1.0
    events.sort(key=self_us, reverse=True)
    return [
        {
            "name": e.key[:160],
            "ms_per_step": self_us(e) / 1e3 / steps,
            "calls_per_step": e.count / steps,
            "pct": 100.0 * self_us(e) / total,
            "time": "device" if on_device else "cpu",
        }
        for e in events[:top]
    ]


HOST_BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that hold the host until the GPU gets there (`cudaMemcpy` without Async: pageable copies)."""


def host_blocked_summary(prof: profile, steps: int = 1) -> dict:
    """Host time per step spent waiting for the GPU: the blocking CUDA runtime calls, and the CPU time of the
    DeepEP dispatch op, whose normal kernels wait on the host for the received counts."""
    blocking, dispatch_cpu_ms = {}, 0.0
    for event in prof.key_averages():
        if event.key in HOST_BLOCKING_CALLS:
            blocking[event.key] = {
                "ms_per_step": event.cpu_time_total / 1e3 / steps,
                "calls_per_step": event.count / steps,
            }
        elif event.key == "deepep::dispatch":
            dispatch_cpu_ms = event.cpu_time_total / 1e3 / steps
    total = sum(call["ms_per_step"] for call in blocking.values())
    return {
        "blocking_calls": blocking,
        "blocking_ms_per_step": total,
        "deepep_dispatch_cpu_ms_per_step": dispatch_cpu_ms,
    }
