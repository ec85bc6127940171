"""Exact resume: a run stopped and restarted with the same command continues bit for bit."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.forkserver import CONTEXT
from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, _trainer_rank, read_losses, run_trainer
from tests.timeouts import generous_timeout
from torchtitan.datasets.corpus import TINYCORPUS_PATH

CKPT_ARGS = ["--checkpoint.enable", "--checkpoint.interval", "5"]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        # one process computes under bf16 autocast with bf16 weights and fp32 masters, fp32 gradient sums over the
        # 2 micro-batches (components/master_weights.py)
        (1, ["--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "2"]),
        (
            4,
            [
                "--parallelism.data_parallel_shard_degree",
                "4",
                "--parallelism.expert_parallel_degree",
                "2",
                "--training.global_batch_size",
                "8",
                "--training.local_batch_size",
                "2",
            ],
        ),
        # EP = FSDP degree: the experts stay outside FSDP, bf16 DTensors with fp32 masters, fp32 gradient sums over
        # 2 micro-batches (parallelize.experts_outside_fsdp)
        (
            2,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--training.mixed_precision_param",
                "bfloat16",
                "--training.global_batch_size",
                "8",
                "--training.local_batch_size",
                "2",
            ],
        ),
    ],
    ids=["single-process", "fsdp4-ep2", "fsdp2-ep2-bf16-experts"],
)
def test_resume_is_bitwise_identical(tmp_path, nproc, layout):
    """A fresh process given a copy of the straight run's step-3 checkpoint continues to step 6 bit for bit (the
    killed-run test below stops a run itself), validating at steps 4 and 6 on the way: validation (here on a corpus
    of its own, so the training stream is the straight run's) changes nothing in training."""
    args = [*FAST_ARGS, *layout, "--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, args, nproc=nproc)
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    validation = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                  "--validation.dataset_path", str(TINYCORPUS_PATH)]  # fmt: skip
    run_trainer(resumed, [*args, *validation], nproc=nproc)
    expected, got = read_losses(straight), read_losses(resumed)
    assert sorted(got) == [4, 5, 6]  # resumed at step 3, no re-training from scratch
    for step in got:
        assert got[step] == expected[step], step  # bitwise on CPU: same data order, RNG and optimizer state
    assert sorted(read_losses(resumed, "validation/loss")) == [4, 6]


def test_killed_run_restarts_from_latest_complete_checkpoint(tmp_path):
    """SIGKILL mid-training, then rerun the same command: it resumes and ends where a straight run ends."""
    # killed once step-6 is on disk: steps 7-15 leave the trainer seconds of work, so the kill lands mid-training
    args = [*FAST_ARGS, "--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "15"]
    run_trainer(tmp_path / "straight", args)

    dump = tmp_path / "killed"
    # `python -m torchtitan.train` in a process group of its own, forked from the suite's server (a fresh
    # interpreter's import of torch adds seconds and nothing to what a SIGKILL mid-training tests)
    argv = ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    output = (tmp_path / "killed.out", tmp_path / "killed.err")
    proc = CONTEXT.Process(target=_trainer_in_own_session, args=(argv, os.getcwd(), env, *output))
    proc.start()
    limit = generous_timeout(300)
    deadline = time.monotonic() + limit
    while not (dump / "checkpoint" / "step-6").exists():
        assert proc.exitcode is None, f"trainer exited before its second checkpoint: {output[1].read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint within {limit:.0f} s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL

    run_trainer(dump, args)
    expected, got = read_losses(tmp_path / "straight"), read_losses(dump)
    for step in range(7, 16):
        assert got[step] == expected[step], step
    # the rerun replaced what the killed run logged after step 6: every step once, in order
    assert [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()] == [*range(1, 16)]


def _trainer_in_own_session(argv: list[str], cwd: str, env: dict[str, str], stdout: Path, stderr: Path) -> None:
    """The trainer as a session leader: a SIGKILL of its process group ends it and whatever it started."""
    os.setsid()
    _trainer_rank(argv, cwd, env, stdout, stderr)


RESHARD_ARGS = [*FAST_ARGS, *CKPT_ARGS, "--training.global_batch_size", "8", "--training.steps", "8"]


@pytest.fixture(scope="module")
def saved_with_fsdp_x_ep(tmp_path_factory) -> Path:
    """One FSDP=2 x EP=2 run of 8 steps (checkpoints at 5 and 8), shared by the resharding tests."""
    saved = tmp_path_factory.mktemp("saved_fsdp2_ep2")
    fsdp_ep = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    run_trainer(saved, [*RESHARD_ARGS, *fsdp_ep, "--training.local_batch_size", "4"], nproc=2)
    return saved


@pytest.mark.parametrize(
    "nproc, layout",
    [(2, ["--parallelism.data_parallel_shard_degree", "2"]), (1, [])],
    ids=["to-fsdp2", "to-single-process"],
)
def test_checkpoint_reshards_from_fsdp_x_ep(tmp_path, saved_with_fsdp_x_ep, nproc, layout):
    """Saved with FSDP=2 x EP=2, resumed with plain FSDP=2 or in one process (the dataloader position reshards
    too): the continuation matches the original layout's."""
    reference = read_losses(saved_with_fsdp_x_ep)
    resumed = tmp_path / "resumed"
    shutil.copytree(saved_with_fsdp_x_ep / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    local_batch = str(8 // nproc)
    run_trainer(resumed, [*RESHARD_ARGS, *layout, "--training.local_batch_size", local_batch], nproc=nproc)
    got = read_losses(resumed)
    assert sorted(got) == [6, 7, 8]  # resumed from step 5, no re-training from scratch
    for step in (6, 7, 8):
        # Same math and data, different communication pattern: fp32 sums in another order.
        assert got[step] == pytest.approx(reference[step], rel=1e-5), (step, got[step], reference[step])


def test_model_only_last_save_with_keep_latest_1_resumes_from_the_last_full_checkpoint(tmp_path):
    """keep_latest_k=1 + a model-only final export: rerunning the job with more steps continues from the last
    resumable checkpoint (step 2), not from step 1 (the export used to count as the newest checkpoint). The issue's
    10-then-14 steps with interval 5, scaled down to 4-then-6 with interval 2."""
    dump = tmp_path / "outputs"
    args = [*FAST_ARGS, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1",
            "--checkpoint.last_save_model_only"]  # fmt: skip
    run_trainer(dump, [*args, "--training.steps", "4"])
    assert sorted(os.listdir(dump / "checkpoint")) == ["exports", "step-2"]
    second = run_trainer(dump, [*args, "--training.steps", "6"])
    assert "resumed from" in second.stdout + second.stderr and "step-2" in second.stdout + second.stderr
    assert "training from step 3 to 6" in second.stdout + second.stderr
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [*range(1, 7)]
    assert sorted(os.listdir(dump / "checkpoint")) == ["exports", "step-4"]
    # Steps that save (2, 4, 6) are read on the host at once, the others one step later: each is still timed over its
    # own window. Timed from the log call just before it, a saving step's window was microseconds (tokens/s 1000x the
    # others'). No step of this model runs in under a millisecond, on however fast or idle a host (a load only slows
    # it): a window that short is that bug, not a speed.
    tokens_per_step = 4 * 32  # FAST_ARGS' local batch x seq_len, one rank
    assert all(r["tps"] < tokens_per_step / 1e-3 for r in records), [r["tps"] for r in records]


def test_divergence_stops_before_its_checkpoint_and_another_flavor_is_one_line(dump_folder):
    """--optimizer.lr 1e6, a checkpoint every step: step 1's update (lr 3.3e5) leaves weights whose activations
    overflow fp32 in the RMSNorms (mean square inf, output exactly 0), so step 2's gradient norm is exactly 0 (the
    loss ln(vocab)). Training stops there in one line, before step 2 is saved. Resuming with another
    --model.flavor is one line too (DCP raises a CheckpointException, a BaseException)."""
    args = [*FAST_ARGS, "--optimizer.lr", "1e6", "--checkpoint.enable", "--checkpoint.interval", "1",
            "--training.steps", "3"]  # fmt: skip
    diverged = run_trainer(dump_folder, args, check=False)
    assert diverged.returncode == 1
    message = _one_error_line(diverged)
    assert message.startswith("error: gradient norm 0 at step 2: ") and "--optimizer.lr" in message, message
    assert sorted(os.listdir(dump_folder / "checkpoint")) == ["step-1"]  # no step-2 from the zero gradient
    assert sorted(read_losses(dump_folder)) == [1]

    other_flavor = run_trainer(dump_folder, [*args, "--model.flavor", "debugmodel"], check=False)
    assert other_flavor.returncode == 1
    message = _one_error_line(other_flavor)
    assert message.startswith("error: loading checkpoint ") and "Size mismatch" in message, message
    assert "resume with the values it was saved with" in message


def test_divergence_between_checkpoints_stops_at_the_diverged_step(dump_folder):
    """Without a checkpoint at step 2, its values are read on the host only once step 3 is launched (the device
    keeps running meanwhile): training still stops with step 2's error, and step 2 is never logged."""
    args = [*FAST_ARGS, "--optimizer.lr", "1e6", "--checkpoint.enable=false", "--training.steps", "3"]
    diverged = run_trainer(dump_folder, args, check=False)
    assert diverged.returncode == 1
    message = _one_error_line(diverged)
    assert message.startswith("error: gradient norm 0 at step 2: "), message
    assert sorted(read_losses(dump_folder)) == [1]


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


def test_rerunning_a_finished_job_says_there_is_nothing_to_train(tmp_path):
    args = [*FAST_ARGS, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "2"]
    run_trainer(tmp_path, args)
    before = (tmp_path / "metrics.jsonl").read_text()
    proc = run_trainer(tmp_path, args)
    out = proc.stdout + proc.stderr
    assert "the checkpoint of step 2 already reaches training.steps=2: nothing to train" in out, out[-2000:]
    assert "training from step 3" not in out
    assert (tmp_path / "metrics.jsonl").read_text() == before
