"""Helpers for tests that launch the real trainer in subprocesses (torchrun, gloo, CPU)."""

import json
import os
import socket
import subprocess
import sys
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
    dump_folder: Path, args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `torchrun -m torchtitan.train` (through torchtitan.launch, as run_train.sh does) with the debug config;
    return the finished process. One process runs the trainer directly: the launcher would only add its start-up
    (run_train.sh's own tests cover it with NGPU=1)."""
    launcher = [
        "-m", "torchtitan.launch",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
    ]
    cmd = [
        sys.executable, *(launcher if nproc > 1 else []),
        "-m", "torchtitan.train",
        "--job.config_file", str(DEBUG_CONFIG),
        "--job.dump_folder", str(dump_folder),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def read_losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (the last record wins for a step, so resumed runs read naturally)."""
    losses = {}
    for line in (dump_folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return losses


@pytest.fixture
def dump_folder(tmp_path: Path) -> Path:
    return tmp_path / "outputs"
