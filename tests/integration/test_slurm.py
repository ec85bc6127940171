"""scripts/slurm/train.sbatch on one machine, with Slurm faked: `srun` and `scontrol` are small stubs on PATH and the
job's variables name two nodes, both this host. The job trains across the two "nodes"; Slurm's warning signal
(SIGUSR1 to the batch script, as `--signal=B:USR1@180` sends it) makes every rank save and stop, and the script
requeue the job; the requeued script resumes from that checkpoint and finishes, each step logged once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, _free_port
from tests.timeouts import generous_timeout

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "train.sbatch"
STEPS = 20
ARGS = [
    *FAST_ARGS,
    "--training.local_batch_size", "2",
    "--training.steps", str(STEPS),
    "--checkpoint.enable", "--checkpoint.interval", "100",
    # rank 0 takes 0.2 s longer per step: the steps last until the signal comes
    "--debug.sleep_seconds", "0.2", "--debug.sleep_every_step",
]  # fmt: skip

# srun on one machine: the command once per node of the job, signals passed on to every copy.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=("$!")
done
trap 'interrupted=1; kill -s USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'interrupted=1; kill -s TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
  while :; do
    interrupted=""
    code=0
    wait "$pid" || code=$?
    [[ -n "$interrupted" ]] || break
  done
  (( code > status )) && status=$code
done
exit $status
"""

# scontrol: the job's nodes are this host; a requeue is written down.
SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) for ((node = 0; node < SLURM_NNODES; node++)); do echo localhost; done ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
  *) echo "scontrol stub: $*" >&2; exit 1 ;;
esac
"""


def _job(tmp_path: Path, attempt: int) -> subprocess.Popen:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "tt",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_SUBMIT_DIR": os.getcwd(),  # the test's checkout (conftest.checkout_without_outputs)
        "SLURM_RESTART_COUNT": str(attempt),
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "LOG_DIR": str(tmp_path / "logs"),
        "RDZV_PORT": str(_free_port()),
        "CONFIG_FILE": str(DEBUG_CONFIG),
        "NGPU": "1",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        ["bash", str(SCRIPT), "--job.dump_folder", str(tmp_path / "outputs"), *ARGS],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_the_slurm_script_trains_on_two_nodes_saves_on_the_warning_signal_and_resumes_after_the_requeue(tmp_path):
    metrics = tmp_path / "outputs" / "metrics.jsonl"
    job = _job(tmp_path, attempt=0)
    try:
        deadline = time.monotonic() + generous_timeout(180)
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@180, to the batch script
        output, _ = job.communicate(timeout=generous_timeout(180))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, output[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n", output[-3000:]
    assert "SIGUSR1: every rank finishes its step and the next, saves and exits" in output
    logs = tmp_path / "logs"
    assert sorted(path.name for path in logs.iterdir()) == ["node0-attempt0.log", "node1-attempt0.log"]
    node0 = (logs / "node0-attempt0.log").read_text()
    (saved,) = [line for line in node0.splitlines() if "preempted: every rank stopped after step" in line]
    stopped_at = int(saved.split("after step ")[1].split()[0])
    assert 2 <= stopped_at < STEPS, saved
    assert node0.strip().splitlines()[-1].startswith(f"stopped by SIGUSR1: training stopped after step {stopped_at};")
    assert "preempted: every rank stopped" in (logs / "node1-attempt0.log").read_text()  # rank 1 on its own node

    requeued = _job(tmp_path, attempt=1)
    output, _ = requeued.communicate(timeout=generous_timeout(300))
    assert requeued.returncode == 0, output[-3000:]
    assert f"training from step {stopped_at + 1} to {STEPS}" in (logs / "node0-attempt1.log").read_text()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
