"""The suite against what a user's own runs leave in the checkout."""

import json
import shutil
import subprocess
import sys

from tests.conftest import DEFAULT_DUMP_FOLDER, REPO_ROOT
from tests.timeouts import generous_timeout

# Jobs that name no --job.dump_folder: a preflight call, the profiling checks, run_train.sh's one-line errors
TESTS_OF_JOBS_WITHOUT_A_DUMP_FOLDER = [
    "tests/unit/models/deepseek_v3/test_mtp.py::test_negative_mtp_layers_is_rejected",
    "tests/unit/tools/test_profiling.py::test_bad_profiling_config_fails_preflight",
    "tests/integration/test_train_cli.py::test_bad_input_fails_fast_with_one_line[degrees-vs-world-size]",
]


def test_checkpoints_an_earlier_run_left_in_the_checkout_fail_no_test(tmp_path):
    """After the README's resume example (`--checkpoint.enable`: ./outputs/checkpoint/step-N stays), 13 tests whose
    jobs dump to the default ./outputs stopped on preflight's 'holds checkpoints of an earlier run'."""
    checkout = tmp_path / "checkout"  # a copy of tests/ (its REPO_ROOT is this folder), links to the rest
    shutil.copytree(REPO_ROOT / "tests", checkout / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for entry in REPO_ROOT.iterdir():
        if entry.name not in ("tests", DEFAULT_DUMP_FOLDER):
            (checkout / entry.name).symlink_to(entry)
    earlier = checkout / DEFAULT_DUMP_FOLDER / "checkpoint" / "step-30"
    earlier.mkdir(parents=True)
    (earlier / "complete.json").write_text(json.dumps({"step": 30, "format": "full", "files": {}}))
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "tmp")]
    proc = subprocess.run(
        [*pytest_run, *TESTS_OF_JOBS_WITHOUT_A_DUMP_FOLDER],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=generous_timeout(300),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 passed" in proc.stdout, proc.stdout[-2000:]
