"""StepProfiler writes a trace and a summary of the recorded step; the summary counts the kernels launched inside a
step, however late they ran; bad profiling configs fail in preflight."""

import json

import pytest
import torch

from tests.unit.tools._trace import synthetic_trace
from torchtitan.config import ConfigError
from torchtitan.preflight import check_job
from torchtitan.tools.profiling import StepProfiler, step_summary


def test_records_every_profile_freq_steps(tmp_path):
    config = type(
        "Profiling",
        (),
        dict(enable_profiling=True, profile_freq=4, save_traces_folder="traces", enable_memory_snapshot=False),
    )
    a = torch.randn(64, 64)
    with StepProfiler(config, str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
        for step in range(11, 20):  # a resumed run: training steps 11..19, recorded: its 4th and 8th steps
            a = torch.tanh(a @ a)
            profiler.step(step)

    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["iteration_14", "iteration_18"]
    summary = json.loads((tmp_path / "traces" / "iteration_14" / "rank0_summary.json").read_text())
    assert summary["step"] == 14 and len(summary["profiler_steps"]) == 1  # the one recorded step
    (step,) = summary["profiler_steps"]
    assert step["host_ms"] > 0 and step["device_ms"] == 0 and step["kernels"] == []  # a CPU run launches no kernels
    trace = json.loads((tmp_path / "traces" / "iteration_14" / "rank0_trace.json").read_text())
    assert step["name"] == "ProfilerStep#14"  # named by training step (torch counts from 0 at the profiler's start)
    labels = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert labels == {"ProfilerStep#14"}
    mm = next(event for event in trace["traceEvents"] if event.get("name") == "aten::mm")
    assert mm["args"]["Input Dims"] == [[64, 64], [64, 64]]  # shapes recorded: trace_breakdown.py counts FLOPs


def test_summary_counts_the_kernels_launched_inside_each_step():
    summary = step_summary(synthetic_trace(), top=3, host_waiting_ops={"deepep::dispatch"})

    assert summary["device_ms_launched_outside_steps"] == pytest.approx(0.15)  # queued before the window: left out
    first, second = summary["profiler_steps"]
    assert (first["name"], second["name"]) == ("ProfilerStep#1", "ProfilerStep#2")
    assert first["host_ms"] == pytest.approx(0.9)
    assert first["device_ms"] == pytest.approx(0.84)  # all of it ran after the step's host range, on two streams
    assert [(k["name"][:17], k["launches"]) for k in first["kernels"]] == [
        ("void cutlass::dev", 1),
        ("nvjet_tst_128x256", 1),
        ("void flash::flash", 1),
    ]
    assert first["kernels"][0]["ms"] == pytest.approx(0.4)
    assert first["kernels"][0]["pct"] == pytest.approx(100 * 0.4 / 0.84)
    assert first["host_blocked"] == {
        "blocking_calls": {"cudaStreamSynchronize": {"ms": pytest.approx(0.15), "calls": 1}},
        "blocking_ms": pytest.approx(0.15),
        "waiting_ops_cpu_ms": {"deepep::dispatch": pytest.approx(0.04)},
    }
    assert second["device_ms"] == pytest.approx(0.4)
    assert {k["name"] for k in second["kernels"]} == {"_adamw_kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profiling.enable_profiling", "--profiling.profile_freq", "3"], "profile_freq=3: use >= 4"),
        (["--profiling.enable_memory_snapshot"], "no GPU here"),
    ],
)
def test_bad_profiling_config_fails_preflight(args, message):
    if "--profiling.enable_memory_snapshot" in args and torch.cuda.is_available():
        pytest.skip("the memory snapshot is valid on a GPU machine")
    with pytest.raises(ConfigError, match=message):
        check_job(["--job.config_file", "train_configs/deepseek_v3_debugmodel.toml", *args], world_size=1)
