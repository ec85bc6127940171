"""The launcher around preemption: torchrun passes SIGUSR1 on and waits for the save; a run stopped by a signal ends
in one line and exit code 143."""

import json
import signal

import pytest
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchtitan import launch

TRAIN = ["-m", "torchtitan.train"]


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setenv("LOGLEVEL", "CRITICAL")  # launch.main leaves torchrun's loggers alone (test_process_faults.py)


def test_torchrun_passes_sigusr1_on_and_waits_for_two_steps_and_a_save():
    flags = launch._with_graceful_stop(["--nproc-per-node", "2", *TRAIN])
    assert flags[:4] == ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "1860"]
    assert launch._with_graceful_stop(["--shutdown_timeout=5", *TRAIN])[2:] == ["--shutdown_timeout=5", *TRAIN]
    off = [*TRAIN, "--fault_tolerance.preemption=false"]
    assert launch._with_graceful_stop(off) == off


def test_the_environment_s_shutdown_timeout_is_kept(monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    assert "--shutdown-timeout" not in launch._with_graceful_stop(TRAIN)


def finished_at_step_4_with_a_checkpoint(tmp_path) -> list[str]:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4}) + "\n")
    (tmp_path / "checkpoint" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-4" / "complete.json").write_text("{}")
    return ["--standalone", *TRAIN, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]


@pytest.mark.parametrize("sigval", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_to_the_launcher_is_one_line_and_exit_code_143(tmp_path, monkeypatch, capsys, sigval):
    def main(argv):
        raise SignalException("got a signal", sigval=sigval)

    monkeypatch.setattr(torchrun, "main", main)
    assert launch.main(finished_at_step_4_with_a_checkpoint(tmp_path)) == 143
    assert capsys.readouterr().err.splitlines() == [
        f"stopped by {sigval.name}: training stopped after step 4; the latest complete checkpoint is "
        f"{tmp_path}/checkpoint/step-4: run the same command again to resume from it"
    ]


def test_ranks_that_stopped_on_a_signal_they_agreed_on_are_one_line_too(tmp_path, monkeypatch, capsys):
    # rank 1 got SIGTERM; both saved and exited 143, rank 0 met torchrun's own SIGTERM on its way out
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none")),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=143, error_file=str(tmp_path / "none")),
    }

    def main(argv):
        raise ChildFailedError("torchtitan.train", failures)

    monkeypatch.setattr(torchrun, "main", main)
    assert launch.main(finished_at_step_4_with_a_checkpoint(tmp_path)) == 143
    assert capsys.readouterr().err.startswith("stopped by a signal: training stopped after step 4; the latest ")
