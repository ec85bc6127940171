"""Process faults through run_train.sh: a busy dump folder, a killed launcher, Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import DEBUG_CONFIG, FAST_ARGS, REPO_ROOT, run_trainer
from tests.timeouts import generous_timeout


def _env() -> dict[str, str]:
    return {**os.environ, "CONFIG_FILE": str(DEBUG_CONFIG), "NGPU": "1", "PYTHON": sys.executable}


def _start_long_run(dump: Path) -> subprocess.Popen:
    """run_train.sh in its own process group (as a terminal job is), training until stopped."""
    args = [*FAST_ARGS, "--training.steps", "100000", "--job.dump_folder", str(dump)]
    launcher = subprocess.Popen(
        ["bash", "run_train.sh", *args], cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    limit = generous_timeout(180)
    deadline = time.monotonic() + limit
    while not (dump / "metrics.jsonl").is_file() or not (dump / "metrics.jsonl").read_text():
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the run logged no step in {limit:.0f} s"
        time.sleep(0.5)
    return launcher


def _trainer_pids(dump: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "torchtitan.train" in cmdline and str(dump) in cmdline and "torchtitan.launch" not in cmdline:
                pids.append(int(entry.name))
    return pids


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_busy_dump_folder_is_refused_and_kill_9_of_the_launcher_ends_its_workers(tmp_path):
    dump = tmp_path / "outputs"
    launcher = _start_long_run(dump)
    try:
        second = subprocess.run(
            ["bash", "run_train.sh", *FAST_ARGS, "--job.dump_folder", str(dump)], cwd=REPO_ROOT, env=_env(),
            capture_output=True, text=True, timeout=generous_timeout(180),
        )  # fmt: skip
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode != 0 and len(lines) == 1, second.stderr[-2000:]
        assert lines[0].startswith("error: another training run") and str(dump) in lines[0]

        workers = _trainer_pids(dump)
        assert workers
        os.killpg(launcher.pid, signal.SIGKILL)
        assert _wait_gone(workers, generous_timeout(30)) == [], "workers outlived their killed launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in _trainer_pids(dump):
            os.kill(pid, signal.SIGKILL)
        launcher.communicate()


def test_ctrl_c_ends_with_one_line_and_exit_code_130(tmp_path):
    dump = tmp_path / "outputs"
    launcher = _start_long_run(dump)
    workers = _trainer_pids(dump)
    os.killpg(launcher.pid, signal.SIGINT)  # what a terminal sends the foreground job on Ctrl-C
    _, stderr = launcher.communicate(timeout=generous_timeout(180))
    assert launcher.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert _launcher_lines(stderr) == [stderr.strip().splitlines()[-1]], stderr[-3000:]  # torchrun's own are off
    assert stderr.strip().splitlines()[-1].startswith("interrupted: training stopped after step ")
    assert _wait_gone(workers, generous_timeout(30)) == []


def _launcher_lines(output: str) -> list[str]:
    """The lines not printed by a worker (torchrun tags those with [rank<N>]:)."""
    return [line for line in output.strip().splitlines() if not line.startswith("[rank")]


# main(), then the names of the process's threads that are still running.
_MAIN_THEN_THREADS = """
import os, sys
from torchtitan.train import main
code = main(sys.argv[1:])
threads = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
print("threads after main:", threads)
sys.exit(code)
"""


def test_finished_run_frees_its_process_groups_before_exit(tmp_path):
    """Gloo's worker threads are joined when main() returns: left to interpreter finalization, one that still
    releases a collective's tensors aborts the finished process ("terminate called without an active exception")."""
    args = [*FAST_ARGS, "--training.steps", "2", "--training.local_batch_size", "2",
            "--parallelism.expert_parallel_degree", "2", "--checkpoint.enable=false"]  # fmt: skip
    run = run_trainer(tmp_path, args, nproc=2, entry=("-c", _MAIN_THEN_THREADS))
    reports = [line for line in run.stdout.splitlines() if line.startswith("threads after main:")]
    assert len(reports) == 2, run.stdout[-2000:]
    for report in reports:
        assert "gloo" not in report, report


# Loaded at interpreter start (a sitecustomize.py on PYTHONPATH): on rank $OOM_RANK, the $OOM_STEP-th optimizer step
# raises the allocator's out-of-memory error, after writing the time it did to $OOM_MARK.
_OUT_OF_MEMORY_ON_ONE_RANK = """
import os, time
if os.environ.get("RANK") == os.environ.get("OOM_RANK"):
    import torch
    from torchtitan.components import optimizer

    _step, _calls = optimizer.OptimizersContainer.step, []

    def step(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == int(os.environ["OOM_STEP"]):
            open(os.environ["OOM_MARK"], "w").write(str(time.time()))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return _step(self, *args, **kwargs)

    optimizer.OptimizersContainer.step = step
"""


def test_out_of_memory_on_a_hidden_rank_is_one_line_and_stops_every_rank(tmp_path):
    """Rank 1 of 2 runs out of memory at step 2 while LOG_RANK=0 hides its output: the launcher's last line names
    the rank, the step and the settings that lower the peak; no traceback; rank 0, left waiting inside a collective
    the failed rank never joins, is stopped within seconds, not after a collective timeout."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_OUT_OF_MEMORY_ON_ONE_RANK)
    mark = tmp_path / "oom_time"
    env = {**_env(), "NGPU": "2", "LOG_RANK": "0", "OOM_RANK": "1", "OOM_STEP": "2", "OOM_MARK": str(mark)}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    args = [*FAST_ARGS, "--training.local_batch_size", "2", "--training.steps", "50"]
    args += ["--job.dump_folder", str(tmp_path / "outputs")]
    launcher = subprocess.run(
        ["bash", "run_train.sh", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=generous_timeout(300),
    )
    stopped = time.time()
    assert launcher.returncode == 1, launcher.stderr[-3000:]
    assert "Traceback" not in launcher.stderr, launcher.stderr[-3000:]
    mentions = [line for line in launcher.stderr.splitlines() if "out of device memory" in line]
    assert len(mentions) == 1, launcher.stderr[-3000:]  # rank 1's own line is filtered out; the launcher's stays
    assert _launcher_lines(launcher.stderr) == [mentions[0]], launcher.stderr[-3000:]
    assert mentions[0].startswith("training failed: rank 1 exited with code 1: error: rank 1 ran out of device ")
    assert "at step 2" in mentions[0] and "--training.local_batch_size" in mentions[0]
    assert "--activation_checkpoint.mode full" in mentions[0]
    assert stopped - float(mark.read_text()) < generous_timeout(30), "the other rank was not stopped at once"


# On rank 0, the first optimizer step asks the CPU allocator for 1 PiB (past any address space): a real allocation
# failure, the one a batch too large for the host's memory meets.
_CPU_ALLOCATION_FAILS = """
import torch
from torchtitan.components import optimizer

def step(self, *args, **kwargs):
    torch.empty(2**50, dtype=torch.uint8)

optimizer.OptimizersContainer.step = step
"""


def test_a_failed_cpu_allocation_is_one_out_of_memory_line_naming_the_fix(tmp_path):
    """The CPU allocator's RuntimeError (a 68-line traceback before) ends the run as the GPU's out-of-memory does: one
    line naming the rank, the step and the settings that lower the peak on a CPU."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_CPU_ALLOCATION_FAILS)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(hook), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [*FAST_ARGS, "--training.steps", "2", "--job.dump_folder", str(tmp_path / "outputs")]
    launcher = subprocess.run(
        ["bash", "run_train.sh", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=generous_timeout(300),
    )  # fmt: skip
    assert launcher.returncode == 1, launcher.stderr[-3000:]
    assert "Traceback" not in launcher.stderr, launcher.stderr[-3000:]
    line = launcher.stderr.strip().splitlines()[-1]
    assert line.endswith(
        "error: rank 0 ran out of CPU memory at step 1 (an allocation of 1048576.0 GiB failed); lower the peak with "
        "a smaller --training.local_batch_size or --training.seq_len (fewer tokens per rank), or "
        "--activation_checkpoint.mode full"
    ), launcher.stderr[-3000:]


def test_the_launcher_knows_which_ranks_output_is_shown():
    from torchtitan.launch import _output_shown

    run = ["--nproc-per-node", "2", "--local-ranks-filter", "0", "--role", "rank", "-m", "torchtitan.train"]
    assert _output_shown(0, run) and not _output_shown(1, run)
    assert _output_shown(1, ["--local-ranks-filter=0,1", "-m", "torchtitan.train"])
    assert _output_shown(1, ["--nproc-per-node", "2", "-m", "torchtitan.train", "--local-ranks-filter", "0"])


def test_the_interrupt_line_says_what_a_rerun_does(tmp_path):
    from torchtitan.launch import _where_it_stopped

    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    run = ["-m", "torchtitan.train", "--job.dump_folder", str(tmp_path)]
    assert "enable --checkpoint.enable" in _where_it_stopped(run)
    enabled = _where_it_stopped([*run, "--checkpoint.enable", "--checkpoint.interval", "5"])
    assert "before its first checkpoint (every 5 steps)" in enabled and "enable --checkpoint" not in enabled


def test_more_processes_than_cores_without_a_gpu_is_one_warning_line(monkeypatch, capsys):
    """NGPU=8 on a 2-core CPU machine started 8 processes without a word."""
    import torch
    from torch.distributed import run as torchrun

    from torchtitan import launch

    monkeypatch.setenv("LOGLEVEL", "CRITICAL")  # launch.main leaves torchrun's loggers alone (see below)
    monkeypatch.setattr(torchrun, "main", lambda argv: None)  # no process started
    monkeypatch.setattr(launch, "_usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def launch_err(nproc: int) -> str:
        assert launch.main(["--nproc-per-node", str(nproc), "--standalone", "-m", "torchtitan.train"]) == 0
        return capsys.readouterr().err

    assert launch_err(8) == (
        "warning: 8 processes per node (NGPU, torchrun's --nproc-per-node) on 2 CPU cores and no GPU: they take turns "
        "on the cores and wait for each other in every collective; set NGPU to 2 or fewer for speed\n"
    )
    assert launch_err(2) == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPUs do the work
    assert launch_err(8) == ""


def test_a_rank_killed_by_sigkill_points_at_host_memory(tmp_path, monkeypatch, capsys):
    # `--training.seq_len 8192` on a small host: the kernel's OOM killer ends rank 0 and leaves no output above
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan import launch

    def killed(exitcode: int):
        def main(argv):
            failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(tmp_path / "none"))
            raise ChildFailedError("torchtitan.train", {0: failure})

        return main

    argv = ["--nproc-per-node", "1", "--standalone", "-m", "torchtitan.train"]
    # launch.main quiets torchrun through LOGLEVEL and logger levels, process-wide: set here, it leaves them alone
    # (the later launcher subprocesses of this pytest process would inherit LOGLEVEL and skip their quieting)
    monkeypatch.setenv("LOGLEVEL", "CRITICAL")
    monkeypatch.setattr(torchrun, "main", killed(-signal.SIGKILL))
    assert launch.main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "training failed: rank 0 was killed by signal 9 (its output is above); SIGKILL is often the host running out "
        "of memory: lower --training.seq_len or --training.local_batch_size"
    ]
    monkeypatch.setattr(torchrun, "main", killed(-signal.SIGSEGV))
    launch.main(argv)
    assert "memory" not in capsys.readouterr().err


def test_a_rank_killed_by_a_signal_is_named_even_after_another_rank_s_error_line(tmp_path, monkeypatch, capsys):
    """kill -9 of rank 1: rank 2 fails on the lost connection and prints its error line, rank 0 is stopped by torchrun
    (SIGTERM), and torchrun may list either first; the launcher names rank 1, whose output LOG_RANK=0 hides."""
    import json

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan import launch
    from torchtitan.tools.lost_peer import lost_peer_line

    reported = tmp_path / "rank2_error.json"
    reported.write_text(json.dumps({"message": lost_peer_line(2, 3, "Connection reset by peer"), "timestamp": 1}))
    none = str(tmp_path / "none")
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGTERM, error_file=none),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGKILL, error_file=none),
        2: ProcessFailure(local_rank=2, pid=3, exitcode=1, error_file=str(reported)),
    }
    failures[0].timestamp = 0  # the earliest, by torchrun's whole seconds

    def main(argv):
        raise ChildFailedError("torchtitan.train", failures)

    monkeypatch.setenv("LOGLEVEL", "CRITICAL")  # see test_a_rank_killed_by_sigkill_points_at_host_memory
    monkeypatch.setattr(torchrun, "main", main)
    monkeypatch.setattr(launch, "_usable_cores", lambda: 8)  # 3 ranks on CI's 2 cores: the launcher's warning too
    argv = ["--nproc-per-node", "3", "--standalone", "--local-ranks-filter", "0", "-m", "torchtitan.train"]
    assert launch.main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "training failed: rank 1 was killed by signal 9; SIGKILL is often the host running out of memory: lower "
        "--training.seq_len or --training.local_batch_size"
    ]


def test_a_rank_that_only_lost_its_peer_is_not_named_as_the_cause(tmp_path, monkeypatch, capsys):
    # rank 1 ran out of memory and exited; rank 0, inside a collective with it, reported the lost peer first
    import json

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan import launch
    from torchtitan.tools.lost_peer import lost_peer_line

    lines = {0: lost_peer_line(0, 2, "Connection closed by peer"), 1: "error: rank 1 ran out of device memory"}
    failures = {}
    for rank, line in lines.items():
        (tmp_path / f"{rank}.json").write_text(json.dumps({"message": line, "timestamp": 1}))
        failures[rank] = ProcessFailure(
            local_rank=rank, pid=rank, exitcode=1, error_file=str(tmp_path / f"{rank}.json")
        )

    def main(argv):
        raise ChildFailedError("torchtitan.train", failures)

    monkeypatch.setenv("LOGLEVEL", "CRITICAL")  # see test_a_rank_killed_by_sigkill_points_at_host_memory
    monkeypatch.setattr(torchrun, "main", main)
    argv = ["--nproc-per-node", "2", "--standalone", "--local-ranks-filter", "0", "-m", "torchtitan.train"]
    assert launch.main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "training failed: rank 1 exited with code 1: error: rank 1 ran out of device memory"
    ]


def test_a_rendezvous_host_the_name_server_never_answers_for_fails_in_seconds(monkeypatch):
    # an unresolvable endpoint made torchrun retry for 112 s, then print a traceback
    import socket
    import threading

    from torchtitan import launch

    never = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: never.wait())
    monkeypatch.setattr(launch, "RESOLVE_TIMEOUT_S", 0.5)
    argv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "-m", "torchtitan.train"]
    begin = time.monotonic()
    problem = launch._rendezvous_problem(argv)
    assert problem.endswith(
        "(RDZV_ENDPOINT, torchrun's --rdzv-endpoint): its host 'node0' did not resolve within 0.5 s (no answer from "
        "the name server); set it to host:port of the rendezvous host (the same on every node), e.g. node0:29400"
    )
    assert time.monotonic() - begin < generous_timeout(10)
    never.set()
    assert launch._rendezvous_problem(["--standalone", "-m", "torchtitan.train"]) is None


# Loaded at interpreter start (a sitecustomize.py on PYTHONPATH): on rank $KILL_RANK, the $KILL_SAVE-th checkpoint
# write (an async save's, in its background thread) SIGKILLs its own process, as `kill -9` or the OOM killer would.
_KILLED_DURING_A_SAVE = """
import os, signal
if os.environ.get("RANK") == os.environ.get("KILL_RANK"):
    from torch.distributed.checkpoint import filesystem

    _write, _calls = filesystem.FileSystemWriter.write_data, []

    def write_data(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == int(os.environ["KILL_SAVE"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return _write(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = write_data
"""


def test_a_rank_killed_during_an_async_save_is_named_and_the_disk_is_not_blamed(tmp_path):
    """Rank 1 of 2 dies (SIGKILL) while its async save of step 2 writes; LOG_RANK=0 hides its output. Rank 0's save
    fails on the lost connection: its line must not blame the disk ("writable with free space"), and the launcher's
    last line names rank 1, however torchrun orders the two failures."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILLED_DURING_A_SAVE)
    env = {**_env(), "NGPU": "2", "LOG_RANK": "0", "KILL_RANK": "1", "KILL_SAVE": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    args = [*FAST_ARGS, "--training.local_batch_size", "2", "--training.steps", "50", "--checkpoint.enable",
            "--checkpoint.async_mode", "async", "--checkpoint.interval", "1",
            "--job.dump_folder", str(tmp_path / "out")]  # fmt: skip
    launcher = subprocess.run(
        ["bash", "run_train.sh", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=generous_timeout(300),
    )  # fmt: skip
    assert launcher.returncode == 1, launcher.stderr[-3000:]
    assert "writable with free space" not in launcher.stderr, launcher.stderr[-3000:]
    assert "Traceback" not in launcher.stderr, launcher.stderr[-3000:]
    assert _launcher_lines(launcher.stderr) == [
        "training failed: rank 1 was killed by signal 9; SIGKILL is often the host running out of memory: lower "
        "--training.seq_len or --training.local_batch_size"
    ], launcher.stderr[-3000:]
    errors = [line for line in launcher.stderr.splitlines() if "error: " in line]
    assert all("another rank died" in line for line in errors), errors  # rank 0's line, when it got to print one
    assert (tmp_path / "out" / "checkpoint" / "step-1" / "complete.json").is_file()  # what a rerun resumes from
