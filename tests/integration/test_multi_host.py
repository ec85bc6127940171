"""The README's multi-host launch on one machine: two launchers (`NNODES=2`, a local c10d rendezvous), each one
process, train FSDP x EP across the two "hosts"; one launcher killed mid-run, both started again resume from the
last complete checkpoint and end with the losses of the same job run straight through.

The straight run is the same two ranks forked by `run_trainer` (no launcher: two fresh interpreters and two torchrun
agents fewer, ~20 s on two cores): the two-launcher job, started, killed and started again, must match it bit for bit,
which also shows that two launchers train what one job of two ranks trains."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, REPO_ROOT, _free_port, read_losses, run_trainer
from tests.timeouts import generous_timeout

ARGS = [
    *FAST_ARGS,
    "--parallelism.expert_parallel_degree", "2",
    "--training.local_batch_size", "2",
    "--checkpoint.enable", "--checkpoint.interval", "3",
    "--training.steps", "12",
]  # fmt: skip


def _start_hosts(dump: Path, port: int) -> list[subprocess.Popen]:
    """Both launchers of the job, each in its own process group (a host's launcher and its workers)."""
    env = {
        **os.environ,
        "CONFIG_FILE": str(DEBUG_CONFIG),
        "NGPU": "1",
        "NNODES": "2",
        "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "RDZV_ID": f"test-{port}",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    return [
        subprocess.Popen(
            ["bash", "run_train.sh", "--job.dump_folder", str(dump), *ARGS],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]


def _finish(hosts: list[subprocess.Popen]) -> None:
    for host in hosts:
        _, err = host.communicate(timeout=generous_timeout(300))
        assert host.returncode == 0, err[-3000:]


def test_two_launchers_train_as_two_hosts_and_resume_after_one_is_killed(tmp_path):
    straight = tmp_path / "straight"
    run_trainer(straight, ARGS, nproc=2)
    expected = read_losses(straight)
    assert sorted(expected) == list(range(1, 13))

    dump = tmp_path / "killed"
    hosts = _start_hosts(dump, _free_port())
    limit = generous_timeout(300)
    deadline = time.monotonic() + limit
    while not (dump / "checkpoint" / "step-6").exists():
        exited = [host.communicate()[1][-3000:] for host in hosts if host.poll() is not None]
        assert not exited, f"a host exited before the second checkpoint: {exited}"
        assert time.monotonic() < deadline, f"no checkpoint within {limit:.0f} s"
        time.sleep(0.05)
    os.killpg(hosts[1].pid, signal.SIGKILL)  # the second host's launcher and its worker
    hosts[1].wait()
    _, err = hosts[0].communicate(timeout=generous_timeout(300))  # the first host's worker loses its peer and stops
    assert hosts[0].returncode != 0
    assert not (dump / "checkpoint" / "step-12").exists()

    _finish(_start_hosts(dump, _free_port()))
    got = read_losses(dump)
    for step in range(7, 13):
        assert got[step] == expected[step], step
    # every step once, in order: the rerun replaced what the killed run logged after its last checkpoint
    assert [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()] == [*range(1, 13)]
