"""StepProfiler writes a trace and an op summary for the recorded step; bad profiling configs fail in preflight."""

import json

import pytest
import torch

from torchtitan.config import ConfigError
from torchtitan.preflight import check_job
from torchtitan.tools.profiling import StepProfiler


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
    names = {row["name"] for row in summary["ops"]}
    assert {"aten::mm", "aten::tanh"} <= names
    mm = next(row for row in summary["ops"] if row["name"] == "aten::mm")
    assert mm["calls_per_step"] == 1 and mm["ms_per_step"] > 0
    trace = json.loads((tmp_path / "traces" / "iteration_14" / "rank0_trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


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
