"""Helpers for tests that run the real trainer in subprocesses (one per rank, gloo, CPU)."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from tests.forkserver import CONTEXT, adopt_environment
from tests.timeouts import generous_timeout
from torchtitan import train

REPO_ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = REPO_ROOT / "train_configs" / "deepseek_v3_debugmodel.toml"

# Small enough that a step takes ~0.1 s on one CPU core, large enough to exercise every path (debugmodel_tiny: the
# debug model's structure at 1/20 of its size).
FAST_ARGS = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--training.global_batch_size", "4",
    "--metrics.log_freq", "1",
    "--training.mixed_precision_param", "float32",
    "--debug.deterministic",
]  # fmt: skip


PARITY_ARGS = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--debug.deterministic",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable=false",
]  # fmt: skip
"""A parity test's runs: the tiny model in fp32, deterministic, nothing checkpointed; each layout adds its local batch
and the test its steps."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_trainer(
    dump_folder: Path,
    args: list[str],
    nproc: int = 1,
    timeout: int = 600,
    check: bool = True,
    entry: tuple[str, ...] | None = None,
    patch: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run the trainer with the debug config on `nproc` ranks; return the finished run, its stdout and stderr the
    ranks' in rank order.

    Each rank is started with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and runs what
    `python -m torchtitan.train` runs, `torchtitan.train.main`, in a process forked from `tests.forkserver` (no
    import of its own). With `entry`, ranks are `python *entry` interpreters instead, for the tests of what a real
    interpreter does at exit. torchrun itself only adds its own start-up and exit, seconds per run on two cores:
    run_train.sh's tests and test_process_faults.py cover the launcher. A rank that fails stops the others, as
    torchrun does. `patch`: an importable function each forked rank calls before `main`, with the rank's environment
    (a fault injected into torch or torchtitan, in that rank's own copy of the modules; no fresh interpreter needed).
    `timeout`: seconds on an idle machine after which the run counts as hung (`generous_timeout` stretches it on a
    loaded one)."""
    # the process groups' timeouts too: one rank compiling or saving on a loaded machine keeps the other waiting
    comm = ["--comm.init_timeout_seconds", str(int(generous_timeout(600)))]
    comm += ["--comm.train_timeout_seconds", str(int(generous_timeout(300)))]
    argv = ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump_folder), *comm, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "PYTHONUNBUFFERED": "1"}
    env |= {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(Path(logs) / f"{rank}.out", Path(logs) / f"{rank}.err") for rank in range(nproc)]
        ranks = []
        for rank, (out, err) in enumerate(outputs):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            if entry is None:
                ranks.append(CONTEXT.Process(target=_trainer_rank, args=(argv, os.getcwd(), rank_env, out, err, patch)))
                ranks[-1].start()
            else:
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    cmd = [sys.executable, *entry, *argv]
                    ranks.append(subprocess.Popen(cmd, env=rank_env, stdout=stdout, stderr=stderr))
        try:
            returncode = _wait_all(ranks, generous_timeout(timeout))
        finally:
            for process in ranks:
                if _exit_code(process) is None:
                    _kill(process)
        stdout, stderr = ("".join(paths[i].read_text() for paths in outputs) for i in (0, 1))
    if check and returncode != 0:
        raise AssertionError(f"trainer failed ({returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def _trainer_rank(
    argv: list[str], cwd: str, env: dict[str, str], stdout: Path, stderr: Path, patch: Callable[[], None] | None = None
) -> None:
    """One rank of `run_trainer`: `python -m torchtitan.train argv` run in `cwd` (the forkserver's is the first
    test's), in a forked process, its output in files; `patch()` first, where given."""
    os.chdir(cwd)
    adopt_environment(env, int(env["OMP_NUM_THREADS"]))
    if patch is not None:
        patch()
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.exit(train.main(argv))


def _exit_code(process: subprocess.Popen | BaseProcess) -> int | None:
    return process.poll() if isinstance(process, subprocess.Popen) else process.exitcode


def _kill(process: subprocess.Popen | BaseProcess) -> None:
    process.kill()
    if isinstance(process, subprocess.Popen):
        process.wait()
    else:
        process.join()


def _wait_all(procs: list, timeout: float) -> int:
    """Wait until every rank has exited (0) or one has failed (its exit code: the others would wait for it in a
    collective); raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [_exit_code(p) for p in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        if None not in codes:
            return 0
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("trainer", timeout)
        time.sleep(0.05)


def read_losses(dump_folder: Path, key: str = "loss") -> dict[int, float]:
    """step -> loss (or `key`, e.g. "validation/loss") from metrics.jsonl (the last record wins for a step, so resumed
    runs read naturally)."""
    losses = {}
    for line in (dump_folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            losses[record["step"]] = record[key]
    return losses


@pytest.fixture
def dump_folder(tmp_path: Path) -> Path:
    return tmp_path / "outputs"
