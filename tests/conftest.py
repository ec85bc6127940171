"""Suite-wide setup."""

import os

import pytest

from torchtitan.datasets.text_datasets import CACHE_DIR_ENV


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
