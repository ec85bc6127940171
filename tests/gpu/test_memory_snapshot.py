"""`--profiling.enable_memory_snapshot` with a compiled region inside a checkpoint, as the trainer runs per-op SAC.

On torch 2.11 recording allocation stacks there raised "SystemError: apply ... returned NULL without setting an
exception" in the first forward (pytorch/pytorch#179536) unless the checkpoint's early stop is off, which
StepProfiler does while it records. The snapshot must then summarise with scripts/bench/memory_breakdown.py."""

import pickle
import types

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from scripts.bench.memory_breakdown import analyse
from torchtitan.tools.profiling import StepProfiler


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(64, 64)
        self.scatter = torch.compile(self._scatter, fullgraph=True)

    @staticmethod
    def _scatter(h, scores, indices, n):
        buf = torch.empty(n * 2, 64, dtype=h.dtype, device=h.device)
        buf[indices] = h
        return (buf.view(n, 2, 64) * scores.unsqueeze(-1)).sum(1)

    def forward(self, x):
        n = x.shape[0]
        h = self.w(x).repeat(2, 1)
        scores = torch.ones(n, 2, device=x.device, dtype=x.dtype)
        return x + self.scatter(h, scores, torch.arange(2 * n, device=x.device), n)


def test_snapshot_of_a_checkpointed_compiled_region(tmp_path):
    config = types.SimpleNamespace(
        enable_profiling=False, profile_freq=4, save_traces_folder="traces", enable_memory_snapshot=True
    )
    model = checkpoint_wrapper(_Block().cuda())
    early_stop = torch.utils.checkpoint._enable_checkpoint_early_stop
    with StepProfiler(config, str(tmp_path), rank=0, device=torch.device("cuda")) as profiler:
        for step in range(1, 5):
            model(torch.randn(256, 64, device="cuda")).sum().backward()
            profiler.step(step)

    with open(tmp_path / "memory_snapshot" / "iteration_4" / "rank0_memory_snapshot.pickle", "rb") as f:
        summary = analyse(pickle.load(f), device=torch.cuda.current_device())
    assert summary["trace_events"] > 0
    assert summary["peak_allocated_gib"] > 0
    assert torch.utils.checkpoint._enable_checkpoint_early_stop == early_stop  # restored when the profiler closed
