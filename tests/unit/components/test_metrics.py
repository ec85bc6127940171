import json
import logging
import os
import re

import pytest
import torch

from torchtitan.components.metrics import (
    DeviceMemoryMonitor,
    MemoryStats,
    MetricsProcessor,
    format_metrics_line,
    get_peak_flops,
)
from torchtitan.config import ConfigError
from torchtitan.config.job_config import JobConfig

LINE = re.compile(
    r"^step: \d+  loss: \d+\.\d{4}  grad_norm: \d+\.\d{4}  memory: (\d+\.\d{2}GiB\(\d+\.\d{2}%\)|n/a)  "
    r"tps: [\d,]+  tflops: \d+\.\d{2}  mfu: (\d+\.\d{2}%|n/a)"
)


def job_config(tmp_path, tensorboard=False):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.metrics.log_freq = 2
    config.metrics.enable_tensorboard = tensorboard
    config.training.local_batch_size = 2
    config.training.seq_len = 8
    return config


def test_cpu_line_has_exact_form_with_na_memory_and_mfu(tmp_path, caplog):
    processor = MetricsProcessor(
        job_config(tmp_path), num_flops_per_token=1e9, device=torch.device("cpu"), is_logging_rank=True
    )
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        record = processor.log(2, loss=7.12345, grad_norm=1.23456, seconds=1.0, steps=2, lr=8e-4, total_steps=10)
    processor.close()
    lines = [r.message for r in caplog.records if r.message.startswith("step: ")]
    assert len(lines) == 1
    line = lines[0]
    assert LINE.match(line), line
    assert line.startswith("step: 2  loss: 7.1235  grad_norm: 1.2346  memory: n/a  tps: ")
    assert "mfu: n/a" in line and "[step 2/10  lr 8.0e-04  eta " in line
    assert record["tps"] > 0 and record["mfu"] is None and record["memory_gib"] is None
    assert record["memory_allocated_gib"] is None
    assert record["tflops"] == pytest.approx(1e9 * record["tps"] / 1e12)


def test_gpu_style_line_formats_memory_thousands_and_mfu():
    record = {
        "step": 10,
        "loss": 7.1234,
        "grad_norm": 1.2345,
        "tps": 1234.4,
        "tflops": 1.234,
        "mfu": 1.2345,
        "lr": None,
    }
    line = format_metrics_line(record, MemoryStats(1.234, 4.5612, 1.1))
    assert line == (
        "step: 10  loss: 7.1234  grad_norm: 1.2345  memory: 1.23GiB(4.56%)  tps: 1,234  tflops: 1.23  mfu: 1.23%"
    )
    assert LINE.match(line)


def test_tps_counts_tokens_per_device_over_the_windows_steps_and_seconds(tmp_path):
    config = job_config(tmp_path)
    config.parallelism.tensor_parallel_degree = 2  # 2 devices share each DP rank's 16 tokens per step
    processor = MetricsProcessor(config, num_flops_per_token=6.0, device=torch.device("cpu"), is_logging_rank=False)
    # 8 tokens per device per step. First window: steps 1..2 over 4 s; second: steps 3..5 over 6 s.
    assert processor.log(2, loss=1.0, grad_norm=1.0, seconds=4.0, steps=2)["tps"] == pytest.approx(2 * 8 / 4)
    record = processor.log(5, loss=1.0, grad_norm=1.0, seconds=6.0, steps=3)
    assert record["tps"] == pytest.approx(3 * 8 / 6)
    assert record["tflops"] == pytest.approx(6.0 * 3 * 8 / 6 / 1e12)
    # A run resumed mid-window ran fewer steps than the step numbers say: the window's own count is used.
    assert processor.log(10, loss=1.0, grad_norm=1.0, seconds=0.5, steps=1)["tps"] == pytest.approx(8 / 0.5)


def test_tps_counts_a_cp_rank_its_share_of_the_sequence(tmp_path):
    """CP ranks load the same samples and each runs 1/cp of every sequence: with CP=2 and TP=2 a device runs a quarter
    of its DP rank's 16 tokens per step."""
    config = job_config(tmp_path)
    config.parallelism.context_parallel_degree = 2
    config.parallelism.tensor_parallel_degree = 2
    processor = MetricsProcessor(config, num_flops_per_token=6.0, device=torch.device("cpu"), is_logging_rank=False)
    assert processor.tokens_per_step == 4
    assert processor.log(2, loss=1.0, grad_norm=1.0, seconds=4.0, steps=2)["tps"] == pytest.approx(2 * 4 / 4)


def test_jsonl_gets_one_flushed_record_per_logged_step(tmp_path):
    processor = MetricsProcessor(
        job_config(tmp_path), num_flops_per_token=1.0, device=torch.device("cpu"), is_logging_rank=True
    )
    processor.log(2, loss=3.0, grad_norm=0.5, seconds=1.0, steps=2, lr=1e-3)
    processor.log(4, loss=2.0, grad_norm=0.25, seconds=1.0, steps=2, lr=1e-3, total_steps=4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # readable before close(): flushed
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4]
    assert set(records[0]) == {
        "step",
        "loss",
        "grad_norm",
        "tps",
        "tflops",
        "mfu",
        "memory_gib",
        "memory_allocated_gib",
        "lr",
        "graphs_compiled",
        "time",
    }
    assert records[1]["loss"] == 2.0 and records[1]["lr"] == 1e-3
    processor.close()


@pytest.mark.parametrize("resume_step, kept", [(2, [1, 2]), (0, [])], ids=["resumed-at-2", "rerun-from-scratch"])
def test_a_run_replaces_the_records_after_where_it_starts(tmp_path, resume_step, kept):
    """A crashed run logged steps 1-4 (and half a line); the rerun resumes at `resume_step` and logs the steps after
    it once: metrics.jsonl reads 1..4, not 1, 2, 3, 4, 3, 4. A rerun from scratch keeps the earlier file beside."""
    records = "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (1, 2, 3, 4))
    earlier = records + '{"step": 5, "lo'
    (tmp_path / "metrics.jsonl").write_text(earlier)
    processor = MetricsProcessor(
        job_config(tmp_path), num_flops_per_token=1.0, device=torch.device("cpu"), is_logging_rank=True
    )
    processor.drop_records_after(resume_step)
    for step in range(resume_step + 1, 5):
        processor.log(step, loss=2.0, grad_norm=0.5, seconds=1.0, steps=1)
    processor.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["loss"] == 1.0] == kept
    if resume_step == 0:  # from scratch: the earlier run's file is kept whole beside
        assert (tmp_path / "metrics.jsonl.1").read_text() == earlier


def test_non_logging_rank_writes_nothing(tmp_path, caplog):
    processor = MetricsProcessor(
        job_config(tmp_path, tensorboard=True), num_flops_per_token=1.0, device="cpu", is_logging_rank=False
    )
    with caplog.at_level(logging.INFO):
        processor.log(2, loss=1.0, grad_norm=1.0, seconds=1.0, steps=2)
    processor.close()
    assert not os.listdir(tmp_path)
    assert not any(r.message.startswith("step: ") for r in caplog.records)


def test_tensorboard_event_file_has_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    processor = MetricsProcessor(
        job_config(tmp_path, tensorboard=True), num_flops_per_token=1.0, device="cpu", is_logging_rank=True
    )
    processor.log(2, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, lr=1e-3)
    processor.close()
    tb_dir = tmp_path / "tb"
    files = [f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents")]
    assert files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert {"loss", "grad_norm", "tps", "tflops", "lr"} <= set(events.Tags()["scalars"])
    assert events.Scalars("loss")[0].value == pytest.approx(1.5)


def test_a_resumed_run_replaces_the_crashed_runs_later_steps_in_tensorboard(tmp_path):
    # the crashed run logged steps 1-6; the run resumed from step 4 logs 5 and 6 again: TensorBoard shows each once
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for start, steps, loss in ((0, range(1, 7), 1.0), (4, range(5, 8), 2.0)):
        processor = MetricsProcessor(
            job_config(tmp_path, tensorboard=True), num_flops_per_token=1.0, device="cpu", is_logging_rank=True
        )
        processor.drop_records_after(start)
        for step in steps:
            processor.log(step, loss=loss, grad_norm=0.5, seconds=1.0, steps=1)
        processor.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("loss")]
    assert logged == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0), (7, 2.0)]


def test_wandb_offline_run_gets_the_tensorboard_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb; it is in the dev extra)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = job_config(tmp_path, tensorboard=True)
    config.metrics.enable_wandb = True
    config.metrics.wandb_project, config.metrics.wandb_run_name = "tests", "offline-run"
    processor = MetricsProcessor(config, num_flops_per_token=1.0, device="cpu", is_logging_rank=True)
    run = processor.wandb_run
    assert (run.project, run.name, run.settings.mode) == ("tests", "offline-run", "offline")
    tensorboard, wandb = {}, {}
    monkeypatch.setattr(processor.tb_writer, "add_scalar", lambda tag, value, step: tensorboard.update({tag: value}))
    log = run.log
    monkeypatch.setattr(run, "log", lambda scalars, step: (wandb.update(scalars), log(scalars, step=step)))
    processor.log(2, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, lr=1e-3)
    processor.log_validation(2, loss=2.0, seconds=0.0)
    processor.close()
    assert wandb == tensorboard
    assert wandb["loss"] == 1.5 and wandb["validation/loss"] == 2.0 and wandb["validation/perplexity"] > 7.38
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the run, ready for `wandb sync`


def without_a_wandb_key(monkeypatch, home) -> None:
    """The environment of a user who never ran `wandb login`: no key in the environment, a home without a .netrc,
    online mode; wandb stops before any network access, so the test needs none."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    import wandb

    wandb.teardown()  # wandb keeps the settings an earlier test started it with for the process; a new run has none


def test_wandb_without_an_api_key_is_a_config_error_naming_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb; it is in the dev extra)")
    without_a_wandb_key(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings either
    config = job_config(tmp_path, tensorboard=False)
    config.metrics.enable_wandb = True
    with pytest.raises(ConfigError) as err:  # the trainer's main prints a ConfigError as its one line
        MetricsProcessor(config, num_flops_per_token=1.0, device="cpu", is_logging_rank=True)
    assert str(err.value) == (
        "--metrics.enable_wandb: wandb refused to start (No API key configured. Use `wandb login` to log in.); run "
        "`wandb login`, or set WANDB_MODE=offline to log locally"
    )


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2.25e15),
    ],
)
def test_peak_flops_table(name, flops):
    assert get_peak_flops(name) == flops


def test_unknown_device_falls_back_with_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert get_peak_flops("Some Future GPU") == 312e12
    assert "unknown" in caplog.text


def test_memory_monitor_is_none_on_cpu():
    assert DeviceMemoryMonitor(torch.device("cpu")).get_peak_stats() is None


def test_console_line_names_graphs_compiled_only_when_there_were_some():
    from torchtitan.components.metrics import format_metrics_line

    record = {"step": 3, "loss": 1.0, "grad_norm": 0.5, "tps": 10.0, "tflops": 0.1, "mfu": None, "lr": None}
    assert "compiled" not in format_metrics_line({**record, "graphs_compiled": 0}, None)
    assert "compiled: 2 graphs" in format_metrics_line({**record, "graphs_compiled": 2}, None)


def test_expert_parallel_imbalance_goes_to_the_line_the_jsonl_and_tensorboard(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    processor = MetricsProcessor(
        job_config(tmp_path, tensorboard=True), num_flops_per_token=1.0, device="cpu", is_logging_rank=True
    )
    with caplog.at_level(logging.INFO):
        processor.log(2, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, ep_load_imbalance=[1.25, 1.5])
    processor.close()
    assert "ep_imbalance: 1.50" in caplog.text
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (record["ep_load_imbalance"], record["ep_load_imbalance_max"]) == ([1.25, 1.5], 1.5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Scalars("ep_load_imbalance/moe_layer_1")[0].value == pytest.approx(1.5)
    assert events.Scalars("ep_load_imbalance_max")[0].value == pytest.approx(1.5)


def test_dropped_share_goes_to_the_line_and_the_jsonl_and_warns_once_past_the_threshold(tmp_path, caplog):
    config = job_config(tmp_path)
    config.parallelism.expert_parallel_capacity_factor = 1.0
    processor = MetricsProcessor(config, num_flops_per_token=1.0, device="cpu", is_logging_rank=True)
    with caplog.at_level(logging.INFO):
        processor.log(2, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, dropped_fraction=0.004)
        processor.log(4, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, dropped_fraction=0.025)
        processor.log(6, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2, dropped_fraction=0.03)
        processor.log(8, loss=1.5, grad_norm=0.5, seconds=1.0, steps=2)  # no capacity: no field
    processor.close()
    assert "dropped: 0.40%" in caplog.text and "dropped: 2.50%" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("2.50% of the routed token copies were dropped at capacity over the last 2 steps")
    assert "--parallelism.expert_parallel_capacity_factor 1.25" in warnings[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("dropped_fraction") for r in records] == [0.004, 0.025, 0.03, None]
