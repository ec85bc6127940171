"""Helpers for tests that run the real trainer in subprocesses (one per rank, gloo, CPU)."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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
]


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
    entry: tuple[str, ...] = ("-m", "torchtitan.train"),
) -> subprocess.CompletedProcess:
    """Run `python -m torchtitan.train` (or `python *entry`) with the debug config on `nproc` ranks; return the
    finished run, its stdout and stderr the ranks' in rank order.

    The ranks are started directly with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...): torchrun
    itself only adds its own start-up and exit, seconds per run on two cores. run_train.sh's tests and
    test_process_faults.py cover the launcher. A rank that fails stops the others, as torchrun does."""
    cmd = [
        sys.executable, *entry,
        "--job.config_file", str(DEBUG_CONFIG),
        "--job.dump_folder", str(dump_folder),
        *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "PYTHONUNBUFFERED": "1"}
    rendezvous = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1"}
    rendezvous["MASTER_PORT"] = str(_free_port())
    with contextlib.ExitStack() as stack:
        logs = [(stack.enter_context(tempfile.TemporaryFile("w+")), stack.enter_context(tempfile.TemporaryFile("w+")))
                for _ in range(nproc)]  # fmt: skip
        procs = [
            subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env={**env, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=out,
                stderr=err,
                text=True,
            )
            for rank, (out, err) in enumerate(logs)
        ]
        try:
            returncode = _wait_all(procs, timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        stdout, stderr = ("".join(_read(log[i]) for log in logs) for i in (0, 1))
    if check and returncode != 0:
        raise AssertionError(f"trainer failed ({returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> int:
    """Wait until every rank has exited (0) or one has failed (its exit code: the others would wait for it in a
    collective); raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        if None not in codes:
            return 0
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(procs[0].args, timeout)
        time.sleep(0.05)


def _read(file) -> str:
    file.seek(0)
    return file.read()


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
