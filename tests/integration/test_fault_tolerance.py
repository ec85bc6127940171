"""Faults on a cluster, injected on CPU ranks (gloo): preemption saves the step every rank stops at and a relaunch
resumes it exactly; a signal or a kill during a save leaves only complete checkpoints; a hung rank is named within
the watchdog's timeout plus 10 s; a slow rank is named by the straggler check."""

import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.conftest import FAST_ARGS, read_losses, run_trainer
from tests.timeouts import generous_timeout
from torchtitan.components.checkpoint_folder import complete_checkpoints, verify_checkpoint_files

STEPS = 8
TWO_RANKS = [*FAST_ARGS, "--training.local_batch_size", "2", "--training.steps", str(STEPS)]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "100"]  # no save before the last step but a preemption's
SLOW_RANK_1 = [
    "--debug.sleep_seconds", "0.3", "--debug.sleep_rank", "1", "--debug.sleep_at_step", "2", "--debug.sleep_every_step",
    "--metrics.straggler_interval", "2", "--metrics.straggler_warn_after", "2", "--metrics.straggler_threshold", "1.05",
]  # fmt: skip
"""From step 2 on, rank 1 loads each batch 0.3 s late; the check runs every 2 steps and warns at its second. Rank 1's
ratio is (c + 0.3) / (c + 0.15) for a step computing c seconds: over 1.05 up to c = 2.7 s, on a loaded machine too."""


@pytest.fixture(scope="module")
def slow_rank_run(tmp_path_factory) -> tuple[Path, str]:
    """A straight run of STEPS steps on two ranks, rank 1 a straggler (a sleep changes no loss): (dump folder,
    output)."""
    dump = tmp_path_factory.mktemp("straight") / "outputs"
    run = run_trainer(dump, [*TWO_RANKS, *SLOW_RANK_1], nproc=2)
    return dump, run.stdout + run.stderr


def test_a_slow_rank_is_named_in_the_metrics_and_in_one_warning(slow_rank_run):
    dump, output = slow_rank_run
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    checks = [record for record in records if "straggler/ratio" in record]
    assert [record["step"] for record in checks] == [2, 4, 6, 8]
    for record in checks:
        assert record["straggler/slowest_rank"] == 1, record
        assert record["straggler/ratio"] > 1.05, record
        assert record["straggler/slowest_data_wait_seconds"] >= 0.3, record
    warnings = [line for line in output.splitlines() if "straggler: rank" in line]
    assert len(warnings) == 1, output[-3000:]
    assert "straggler: rank 1 has been the slowest for 2 checks in a row (every 2 steps, up to step 4)" in warnings[0]


def _sigterm_rank_0_during_each_save() -> None:
    """A rank's patch (`run_trainer`): rank 0 sends itself SIGTERM whenever checkpoint files are written (a second
    signal, during the preemption's save)."""
    from torch.distributed.checkpoint import filesystem

    write_data = filesystem.FileSystemWriter.write_data

    def signalled_write_data(self, *args, **kwargs):
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        return write_data(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = signalled_write_data


def test_sigterm_to_one_rank_saves_the_step_all_stop_at_and_a_relaunch_resumes_exactly(tmp_path, slow_rank_run):
    """Rank 1 gets SIGTERM during step 3: every rank stops after step 4 (they agree at the step end after the
    signal's), saves step 4 (rank 0 gets a second SIGTERM while writing it: recorded, ignored), says so and exits 143;
    the same command again resumes there and ends with the straight run's losses."""
    straight = read_losses(slow_rank_run[0])
    dump = tmp_path / "outputs"
    signal_rank_1 = ["--debug.sigterm_at_step", "3", "--debug.sigterm_rank", "1"]
    run = run_trainer(
        dump, [*TWO_RANKS, *CHECKPOINTS, *signal_rank_1], nproc=2, check=False, patch=_sigterm_rank_0_during_each_save
    )
    output = run.stdout + run.stderr
    assert run.returncode == 143, output[-4000:]
    stops = [line for line in output.splitlines() if "preempted: " in line]
    assert len(stops) == 2, output[-4000:]  # one line per rank
    assert all("every rank stopped after step 4 on SIGTERM; checkpoint step-4 saved in " in line for line in stops)
    assert any("(1 more signal(s) during the save: recorded, ignored)" in line for line in stops)
    folder = dump / "checkpoint"
    assert sorted(path.name for path in folder.iterdir()) == ["step-4"]
    verify_checkpoint_files(str(folder / "step-4"), fix="")  # every file's size and crc32 as its manifest says

    rerun = run_trainer(dump, [*TWO_RANKS, *CHECKPOINTS], nproc=2)
    assert "training from step 5 to 8" in rerun.stderr
    assert read_losses(dump) == straight
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # each step logged once: by the preempted run, then by the relaunch


def _killed_during_the_second_save() -> None:
    """A rank's patch (`run_trainer`): its second checkpoint save is ended mid-write by SIGKILL, as a scheduler's kill
    after its grace time (or a SIGTERM with --fault_tolerance.preemption=false) would."""
    from torch.distributed.checkpoint import filesystem

    write_data, calls = filesystem.FileSystemWriter.write_data, []

    def killed_write_data(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, *args, **kwargs)

    filesystem.FileSystemWriter.write_data = killed_write_data


def test_a_process_killed_during_a_save_leaves_only_complete_checkpoints(tmp_path):
    dump = tmp_path / "outputs"
    four_steps = [*FAST_ARGS, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    run = run_trainer(dump, four_steps, check=False, patch=_killed_during_the_second_save)
    assert run.returncode == -signal.SIGKILL, (run.stdout + run.stderr)[-3000:]
    folder = dump / "checkpoint"
    assert sorted(complete_checkpoints(str(folder))) == [2]  # step 4's files are there, but not as a checkpoint
    assert not (folder / "step-4.tmp" / "complete.json").exists()
    rerun = run_trainer(dump, four_steps)  # the same command resumes from step 2; the unfinished save is cleared
    assert "training from step 3 to 4" in rerun.stderr
    assert sorted(complete_checkpoints(str(folder))) == [2, 4]
    assert not (folder / "step-4.tmp").exists()


HANG_TIMEOUT = 5


def test_a_hung_rank_is_named_within_the_timeout_plus_10_s(tmp_path):
    """Rank 1 stops loading its batch at step 3 (a 600 s sleep); rank 0 waits for it in the step's first collective.
    Both dump their stacks, one line names rank 1, and every rank exits with 124."""
    dump = tmp_path / "outputs"
    hang = ["--fault_tolerance.hang_timeout_seconds", str(HANG_TIMEOUT), "--fault_tolerance.first_step_timeout_seconds"]
    hang += ["120", "--debug.sleep_seconds", "600", "--debug.sleep_rank", "1", "--debug.sleep_at_step", "3"]
    run = run_trainer(dump, [*TWO_RANKS, *hang], nproc=2, check=False)
    ended = time.time()
    output = run.stdout + run.stderr
    assert run.returncode == 124, output[-4000:]
    (slept,) = re.findall(r"^(\S+ \S+) WARNING debug: rank 1 sleeps 600 s at step 3", output, flags=re.M)
    slept_at = datetime.strptime(slept, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert ended - slept_at <= HANG_TIMEOUT + generous_timeout(10), (ended - slept_at, output[-4000:])
    lines = [line for line in output.splitlines() if line.startswith("error: training hung:")]
    assert len(lines) == 1, output[-4000:]
    assert lines[0].startswith(
        "error: training hung: rank 1 did not arrive (step 3, data, in torchtitan/components/fault_tolerance/faults.py"
    ), lines[0]
    assert "rank 0 waits in a collective at step 3 (compute)" in lines[0]
    (folder,) = (dump / "hangs").iterdir()
    assert f"Where each rank is: {folder}/rank<N>.txt" in lines[0]
    assert "in at\n" in (folder / "rank1.txt").read_text()  # the sleeping frame, faults.py's `at`
    assert "in all_reduce\n" in (folder / "rank0.txt").read_text()
    recorded = json.loads((folder / "rank0.flight_recorder.json").read_text())
    assert any(entry["profiling_name"].startswith("gloo:") for entry in recorded["entries"])
