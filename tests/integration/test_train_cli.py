"""The trainer from the command line: it learns, it runs data parallel, and bad input fails in one line."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, read_losses, run_trainer
from tests.timeouts import generous_timeout


def test_debugmodel_loss_falls(dump_folder):
    # the shipped debug model itself through run_train.sh (the README's quick start), not the test suite's smaller
    # flavor, with one multi-token prediction module: its loss falls too; and so does the loss on the held-out
    # documents, validated every 5 steps
    args = [*FAST_ARGS, "--model.flavor", "debugmodel", "--training.steps", "20", "--lr_scheduler.warmup_steps", "2",
            "--model.mtp_layers", "1", "--job.dump_folder", str(dump_folder),
            "--validation.enable", "--validation.freq", "5", "--validation.steps", "2"]  # fmt: skip
    proc = _run_launcher(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = read_losses(dump_folder)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.0, losses
    mtp_losses, validation = read_losses(dump_folder, "mtp_loss"), read_losses(dump_folder, "validation/loss")
    assert mtp_losses[20] < mtp_losses[1] - 1.0, mtp_losses
    assert sorted(validation) == [5, 10, 15, 20] and validation[20] < validation[10] < validation[5] - 0.3, validation
    line = r"step: 20  validation/loss: \d+\.\d{4}  validation/perplexity: \d+\.\d{4}"
    assert re.search(line, proc.stdout + proc.stderr), proc.stdout[-2000:]


def test_metrics_line_format_and_adam_update_rms(dump_folder):
    proc = run_trainer(dump_folder, [*FAST_ARGS, "--training.steps", "2", "--metrics.log_update_rms"])
    out = proc.stdout + proc.stderr
    assert "step: 2  loss: " in out
    pattern = (
        r"step: 2  loss: \d+\.\d{4}  grad_norm: \d+\.\d{4}  memory: \S+  tps: [\d,]+  tflops: \d+\.\d{2}  mfu: \S+"
    )
    assert re.search(pattern, out), out[-2000:]
    # every group of the MoE model, each step. Adam's first update is +-1 where the gradient is not zero: RMS 1 for
    # dense gradients (less where one is within a few eps of 0), the root of the share of touched elements for the
    # embedding rows of 128 tokens
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    groups = ("matrices", "experts", "embeddings", "head", "router_gate", "norms_and_biases")
    first, second = ({group: record[f"update_rms/{group}"] for group in groups} for record in records)
    assert all(first[group] > 0.95 for group in ("matrices", "head", "router_gate", "norms_and_biases")), first
    assert first["embeddings"] < 0.5, first
    assert all(0.0 < rms <= 1.0 for rms in [*first.values(), *second.values()]), (first, second)


def test_an_odd_seq_len_trains_without_context_parallelism(dump_folder):
    # only context parallelism's two chunks per rank need an even length; preflight used to refuse 31 for everyone
    run_trainer(dump_folder, [*FAST_ARGS, "--training.seq_len", "31", "--training.steps", "2"])
    assert sorted(read_losses(dump_folder)) == [1, 2]


def test_folded_clipping_trains_like_clip_grad_norm_and_torch_adamw(tmp_path):
    """The default optimizer (MultiTensorAdamW, clipping folded into the step; its CPU path here) against torch's
    foreach AdamW after clip_grad_norm_, with clipping active every step: the same losses and grad norms."""
    records = {}
    for implementation in ("triton", "foreach"):
        folder = tmp_path / implementation
        args = [*FAST_ARGS, "--training.steps", "4", "--training.max_norm", "0.05",
                "--optimizer.implementation", implementation]  # fmt: skip
        run_trainer(folder, args)
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        records[implementation] = [json.loads(line) for line in lines]
    assert len(records["triton"]) == 4 and all(r["grad_norm"] > 0.05 for r in records["triton"])
    for key in ("loss", "grad_norm"):
        values = {implementation: [r[key] for r in records[implementation]] for implementation in records}
        assert values["triton"] == pytest.approx(values["foreach"], rel=1e-4), key


def _run_launcher(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONFIG_FILE": str(DEBUG_CONFIG), "NGPU": "1", "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(
        ["bash", "run_train.sh", *args],  # in the test's own checkout folder (tests/conftest.py)
        env=env,
        capture_output=True,
        text=True,
        timeout=generous_timeout(360),
    )


@pytest.mark.parametrize(
    "args, env, expected",
    [
        ([], {"CONFIG_FILE": "./train_configs/missing.toml"}, "missing.toml"),
        (["--training.stepz", "3"], {}, "training.steps"),
        (["--training.steps", "three"], {}, "training.steps"),
        (
            ["--model.name", "llama3"],
            {},
            "model.name='llama3' is not a model here; pass one of ['deepseek_v3', 'qwen3_moe']",
        ),
        (["--parallelism.data_parallel_shard_degree", "3"], {"NGPU": "2"}, "world size"),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"],
            {"NGPU": "2"},
            "seq_len",
        ),
        ([], {"NGPU": "0"}, "NGPU=0 is not a positive whole number"),
        ([], {"NGPU": "abc"}, "NGPU=abc is not a positive whole number"),
        (["--checkpoint.load_step", "5"], {}, "add --checkpoint.enable or drop --checkpoint.load_step"),
        ([], {"NGPU": "2", "LOG_RANK": "5"}, "LOG_RANK=5 names local rank '5', but there are 2 per node"),
        ([], {"CONFIG_FILE": "./train_configs"}, "error: CONFIG_FILE './train_configs' is a folder; pick a .toml"),
        ([], {"NNODES": "2"}, "error: NNODES=2 needs RDZV_ENDPOINT: set RDZV_ENDPOINT=host:port"),
        (
            [],
            {"NNODES": "2", "RDZV_ENDPOINT": "node0:29x00"},
            "error: the rendezvous endpoint 'node0:29x00' (RDZV_ENDPOINT, torchrun's --rdzv-endpoint): its port is not "
            "a whole number from 0 to 65535; set it to host:port",
        ),
        (
            [],
            {"NNODES": "2", "RDZV_ENDPOINT": "no-such-host.invalid:29400"},
            "endpoint 'no-such-host.invalid:29400' (RDZV_ENDPOINT, torchrun's --rdzv-endpoint): its host "
            "'no-such-host.invalid' does not resolve (",
        ),
        (
            ["--training.steps", "1"],
            {"TORCHRUN_ARGS": "--bogus-flag 3"},
            "error: torchrun flags: unrecognized arguments: --bogus-flag; check TORCHRUN_ARGS",
        ),
    ],
    ids=[
        "missing-config",
        "unknown-key",
        "wrong-type",
        "model-name",
        "degrees-vs-world-size",
        "seq-len-not-divisible",
        "ngpu-zero",
        "ngpu-not-a-number",
        "load-step-without-checkpointing",
        "log-rank-out-of-range",
        "config-is-a-folder",
        "nnodes-without-rdzv-endpoint",
        "rdzv-port-not-a-number",
        "rdzv-host-unknown",
        "bad-torchrun-args",
    ],
)
def test_bad_input_fails_fast_with_one_line(args, env, expected):
    proc = _run_launcher(args, env)
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1, proc.stderr
    assert expected in error_lines[0], error_lines[0]
    assert "torch.distributed" not in proc.stderr  # failed before torchrun started any process


def test_help_lists_every_field_and_exits_zero():
    proc = _run_launcher(["--help"])
    assert proc.returncode == 0, proc.stderr
    for key in ("--training.local_batch_size", "--parallelism.expert_parallel_comm_backend", "--compile.enable"):
        assert key in proc.stdout


def test_final_hf_export_loads_in_transformers_with_the_logits_of_the_model_trained(dump_folder):
    """Sigmoid routing (DeepSeek-V3's), whose selection bias training moved: transformers' DeepseekV3 uses it. (Softmax
    routing's HF type ignores the bias: preflight refuses its final HF export, test_args.)"""
    import torch
    import transformers  # dev dependency

    from scripts import generate
    from torchtitan.models.spec import get_model_spec

    flavor = ["--model.flavor", "debugmodel_tiny_671b"]
    args = [*FAST_ARGS, *flavor, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.last_save_in_hf"]
    run_trainer(dump_folder, args)
    export = dump_folder / "checkpoint" / "exports" / "step-2"
    assert (export / "config.json").is_file() and (export / "complete.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager")
    spec = get_model_spec("deepseek_v3")
    _, model_args = generate._model_shape(spec, str(export), None, None)
    ours = generate.load_model(spec, str(export), generate.inference_args(model_args), torch.device("cpu"))
    assert any(ours.layers[str(i)].moe.expert_bias.any() for i in range(3, 6))  # trained, and exported
    tokens = torch.randint(0, 2048, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)


def _bad_corpus(tmp_path, kind: str) -> tuple[str, str]:
    """(the --training.dataset_path or dataset flags' value, text the one error line must contain)."""
    good = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3))
    path = tmp_path / "corpus.jsonl"
    if kind == "malformed-jsonl":
        path.write_text(good + "{not json\n")
        return str(path), f"{path}:4: not a JSON object"
    if kind == "text-not-string":
        path.write_text(good + json.dumps({"text": 42}) + "\n")
        return str(path), f"{path}:4: 'text' is a int, not a string"
    if kind == "not-utf8":
        path = tmp_path / "corpus.txt"
        path.write_bytes(b"caf\xe9 au lait\n")
        return str(path), f"{path}: not UTF-8 text"
    if kind == "empty":
        path.write_text("")
        return str(path), "the corpus is empty"
    if kind == "missing":
        return str(tmp_path / "nowhere.jsonl"), "nowhere.jsonl' does not exist"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["malformed-jsonl", "text-not-string", "not-utf8", "empty", "missing"])
def test_bad_dataset_is_one_error_line_before_launch(tmp_path, kind):
    dataset_path, expected = _bad_corpus(tmp_path, kind)
    proc = _run_launcher(["--training.dataset_path", dataset_path, "--job.dump_folder", str(tmp_path / "out")])
    _assert_one_error_line_before_launch(proc, expected)


def test_unknown_dataset_and_unwritable_dump_folder_are_one_error_line(tmp_path):
    proc = _run_launcher(["--training.dataset", "c4", "--job.dump_folder", str(tmp_path / "out")])
    _assert_one_error_line_before_launch(proc, "unknown --training.dataset='c4'")
    (tmp_path / "a_file").write_text("")
    proc = _run_launcher(["--job.dump_folder", str(tmp_path / "a_file" / "outputs")])
    _assert_one_error_line_before_launch(proc, "is not writable")


def _assert_one_error_line_before_launch(proc: subprocess.CompletedProcess, expected: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr[-2000:]
    assert "[rank" not in proc.stdout + proc.stderr  # torchrun never started a worker


def test_bad_record_past_the_preflight_sample_is_one_error_line(dump_folder, tmp_path):
    """Found by the worker, through run_train.sh: the worker's one error line is the only line that is not the
    worker's log (torchrun's own lines are off; the launcher adds none when the error line is on the terminal)."""
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(150)) + "[1, 2]\n")
    proc = _run_launcher([*FAST_ARGS, "--training.dataset_path", str(path), "--job.dump_folder", str(dump_folder)])
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and f"{path}:151: JSON object has no 'text' field" in errors[0], proc.stderr[-2000:]
    assert errors[0] == proc.stderr.strip().splitlines()[-1]
    launcher_lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("[rank")]
    assert launcher_lines == [], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_wandb_without_an_api_key_stops_the_run_with_one_line(dump_folder, tmp_path, monkeypatch):
    # the README promises one line; it was a 13-line traceback (wandb's refusal reached main as a ValueError)
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb; it is in the dev extra)")
    from tests.unit.components.test_metrics import without_a_wandb_key

    (tmp_path / "home").mkdir()
    without_a_wandb_key(monkeypatch, tmp_path / "home")
    run = run_trainer(dump_folder, [*FAST_ARGS, "--training.steps", "1", "--metrics.enable_wandb"], check=False)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: --metrics.enable_wandb: wandb refused to start (No API key configured. Use `wandb login` to log in.); "
        "run `wandb login`, or set WANDB_MODE=offline to log locally"
    )
