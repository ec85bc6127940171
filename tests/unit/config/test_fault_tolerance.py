"""The fault-tolerance options: the watchdog fires before the process groups' timeouts; fault injection aims at a
rank the job has."""

import pytest

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.preflight import check_layout


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


def test_the_defaults_let_the_watchdog_fire_before_the_process_groups_timeouts():
    job = parse()
    assert job.fault_tolerance.hang_timeout_seconds < job.comm.train_timeout_seconds
    assert job.fault_tolerance.first_step_timeout_seconds < job.comm.init_timeout_seconds


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--comm.train_timeout_seconds", "100"],
            "fault_tolerance.hang_timeout_seconds (180) must be shorter than comm.train_timeout_seconds (100): the "
            "process groups' own timeout would stop a hung collective first, without naming the rank it waits for; "
            "lower --fault_tolerance.hang_timeout_seconds or raise --comm.train_timeout_seconds "
            "(--fault_tolerance.hang_timeout_seconds 0 turns the watchdog off)",
        ),
        (["--fault_tolerance.first_step_timeout_seconds", "600"], "must be shorter than comm.init_timeout_seconds"),
        (["--fault_tolerance.hang_timeout_seconds", "-1"], "hang_timeout_seconds must be >= 0 (0: the watchdog off)"),
        (["--metrics.straggler_threshold", "1"], "straggler_threshold must be a finite number > 1"),
        (["--debug.sigterm_rank", "-2"], "sigterm_rank must be -1 (every rank) or a global rank >= 0"),
    ],
)
def test_bad_values_are_refused_with_the_fix(argv, message):
    with pytest.raises(ConfigError) as caught:
        parse(*argv)
    assert message in str(caught.value)


def test_the_watchdog_off_lifts_the_timeout_rule():
    assert parse("--comm.train_timeout_seconds", "100", "--fault_tolerance.hang_timeout_seconds", "0")


def test_a_fault_aimed_at_a_rank_the_job_lacks_is_refused():
    job = parse("--model.flavor", "debugmodel_tiny", "--debug.sleep_seconds", "1", "--debug.sleep_rank", "2")
    with pytest.raises(ConfigError, match=r"debug.sleep_rank=2, but the job has 2 ranks \(0-1\); pass one of those"):
        check_layout(job, world_size=2)
    check_layout(job, world_size=4)
