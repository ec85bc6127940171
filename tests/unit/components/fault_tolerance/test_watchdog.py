"""The watchdog thread on one rank: a phase past its limit dumps the stacks, reports one line and exits 124; the
limits per phase."""

import threading
import time

import torch.distributed as dist

from torchtitan.components.fault_tolerance.watchdog import HANG_EXIT_CODE, HangWatchdog, PhaseLimits


def test_each_phase_has_its_limit():
    limits = PhaseLimits(step=10, first_step=60, save=300)
    assert limits.of("compute", first_step=False) == 10
    assert limits.of("data", first_step=True) == 60
    assert limits.of("validation", first_step=False) == 60
    assert limits.of("checkpoint", first_step=True) == 300


def test_a_stalled_phase_dumps_the_stacks_reports_one_line_and_exits(tmp_path):
    store = dist.HashStore()
    lines, exits, done = [], [], threading.Event()

    def exit(code):
        exits.append(code)
        done.set()

    watchdog = HangWatchdog(PhaseLimits(0.5, 5, 5), store, 0, 1, str(tmp_path), lines.append, exit=exit)
    watchdog.first_step = 1
    watchdog.start()
    watchdog.beat(1, "compute")
    time.sleep(1.0)  # still within the first step's limit
    assert not done.is_set()
    watchdog.beat(2, "data")  # the main thread stops here: `time.sleep` below
    assert done.wait(timeout=10)
    watchdog.stop()
    assert exits == [HANG_EXIT_CODE]
    (line,) = lines
    assert line.startswith("error: training hung: no rank is behind another; rank 0 waits in ")
    assert "at step 2 (data)" in line and f"{tmp_path}/hangs/" in line
    (stacks,) = (tmp_path / "hangs").glob("*/rank0.txt")
    text = stacks.read_text()
    assert text.startswith("rank 0: step 2, phase data, no progress for ")
    assert "test_a_stalled_phase_dumps_the_stacks_reports_one_line_and_exits" in text  # the main thread's stack
