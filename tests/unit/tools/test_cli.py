"""The command lines end quietly where their reader stops early (`| head`)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.timeouts import generous_timeout


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "torchtitan.preflight", "--world-size", "1", "--help"],  # what `run_train.sh --help` runs
        ["-m", "torchtitan.train", "--help"],
        ["-m", "torchtitan.plan", "--job.config_file", "train_configs/deepseek_v3_debugmodel.toml", "--gpu", "h100"],
    ],
    ids=["run_train.sh-help", "train-help", "plan"],
)
def test_output_into_a_pipe_its_reader_closed_ends_quietly(command):
    """`head` exits after 10 lines; the command's next write met the closed pipe: a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes
    try:
        proc = subprocess.run(
            [sys.executable, *command],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=generous_timeout(120),
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE  # as a tool stopped by SIGPIPE
