"""The trainer from the command line: it learns, it runs data parallel, and bad input fails in one line."""

import os
import re
import subprocess
import sys

import pytest

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, REPO_ROOT, read_losses, run_trainer


def test_debugmodel_loss_falls(dump_folder):
    run_trainer(dump_folder, [*FAST_ARGS, "--training.steps", "20", "--lr_scheduler.warmup_steps", "2"])
    losses = read_losses(dump_folder)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.0, losses


def test_two_process_fsdp_matches_one_process(tmp_path):
    args = [*FAST_ARGS, "--training.steps", "3", "--training.global_batch_size", "8"]
    run_trainer(tmp_path / "single", args)
    run_trainer(tmp_path / "fsdp", [*args, "--parallelism.data_parallel_shard_degree", "2"], nproc=2)
    single, fsdp = read_losses(tmp_path / "single"), read_losses(tmp_path / "fsdp")
    for step in single:
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4), (step, single, fsdp)


def test_metrics_line_format(dump_folder):
    proc = run_trainer(dump_folder, [*FAST_ARGS, "--training.steps", "2"])
    out = proc.stdout + proc.stderr
    assert "step: 2  loss: " in out
    pattern = (
        r"step: 2  loss: \d+\.\d{4}  grad_norm: \d+\.\d{4}  memory: \S+  tps: [\d,]+  tflops: \d+\.\d{2}  mfu: \S+"
    )
    assert re.search(pattern, out), out[-2000:]


def _run_launcher(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONFIG_FILE": str(DEBUG_CONFIG), "NGPU": "1", "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(
        ["bash", "run_train.sh", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, env, expected",
    [
        ([], {"CONFIG_FILE": "./train_configs/missing.toml"}, "missing.toml"),
        (["--training.stepz", "3"], {}, "training.steps"),
        (["--training.steps", "three"], {}, "training.steps"),
        (["--parallelism.data_parallel_shard_degree", "3"], {"NGPU": "2"}, "world size"),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"],
            {"NGPU": "2"},
            "seq_len",
        ),
    ],
    ids=["missing-config", "unknown-key", "wrong-type", "degrees-vs-world-size", "seq-len-not-divisible"],
)
def test_bad_input_fails_fast_with_one_line(args, env, expected):
    proc = _run_launcher(args, env)
    assert proc.returncode != 0
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1, proc.stderr
    assert expected in error_lines[0], error_lines[0]
    assert "torch.distributed" not in proc.stderr  # failed before torchrun started any process


def test_help_lists_every_field_and_exits_zero():
    proc = _run_launcher(["--help"])
    assert proc.returncode == 0, proc.stderr
    for key in ("--training.local_batch_size", "--parallelism.expert_parallel_comm_backend", "--compile.enable"):
        assert key in proc.stdout


def test_final_hf_export_loads_in_transformers(dump_folder):
    import torch
    import transformers  # dev dependency

    args = [*FAST_ARGS, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    run_trainer(dump_folder, args)
    export = dump_folder / "checkpoint" / "step-2"
    assert (export / "config.json").is_file() and (export / "complete.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32)
    tokens = torch.randint(0, 2048, (1, 16))
    logits = model(tokens).logits
    assert logits.shape == (1, 16, 2048) and torch.isfinite(logits).all()
