"""Suite-wide setup."""

import os
from pathlib import Path

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.corpus import CACHE_DIR_ENV

# Inductor's CPU kernels scalar, not AVX-512-vectorized C++: the suite's compiled tests check what torchtitan hands the
# compiler (regions, dynamic dims, checkpoints, what backward saves, eager-equal results; the GPU runs Triton kernels,
# not these), and on a cold cache vectorized kernels make every inductor compile 30-40% dearer (their codegen
# and gcc): ~1 CPU-minute of the suite. Set before torch's inductor config is first imported (it reads the variable
# once; the trainer ranks' fork server and every launched process inherit it); a value set by the caller wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DUMP_FOLDER = Path(JobConfig().job.dump_folder).parts[0]
"""`outputs`: the default dump folder (`./outputs`, relative to the working directory), which every shipped TOML dumps
under too: where a user's runs leave checkpoints, metrics and traces."""


@pytest.fixture(scope="session", autouse=True)
def tokenized_corpus_cache(tmp_path_factory):
    """One fresh tokenized-corpus cache for the whole run (trainer subprocesses inherit it): the first run of the
    suite tokenizes the shipped corpus, the others load it, and the user's ~/.cache is left alone."""
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("torchtitan_cache"))
    yield
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV)
    else:
        os.environ[CACHE_DIR_ENV] = previous


@pytest.fixture(autouse=True)
def checkout_without_outputs(tmp_path_factory, monkeypatch) -> Path:
    """Each test runs in a folder of its own laid out like the checkout (a link to each of its entries) without its
    ./outputs: a job that names no --job.dump_folder dumps there, not beside the checkpoints the user's runs left in
    the checkout's ./outputs (preflight refuses those with checkpointing off). `run_trainer`'s ranks and the tests'
    run_train.sh start there too."""
    folder = tmp_path_factory.mktemp("checkout")
    link_checkout_entries(folder)
    monkeypatch.chdir(folder)
    return folder


def link_checkout_entries(folder: Path) -> None:
    """Link each entry of the checkout but its default dump folder into `folder`."""
    for entry in REPO_ROOT.iterdir():
        if entry.name != DEFAULT_DUMP_FOLDER:
            (folder / entry.name).symlink_to(entry)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "multiprocess: runs the trainer (tests/integration) or gloo ranks (run_distributed); "
        '`-m "not multiprocess"` runs the single-process tests',
    )


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts processes: those under tests/integration and those that call run_distributed."""
    for item in items:
        function = getattr(item, "function", None)
        spawns_ranks = function is not None and "run_distributed" in function.__code__.co_names
        if spawns_ranks or "tests/integration/" in item.path.as_posix():
            item.add_marker(pytest.mark.multiprocess)
