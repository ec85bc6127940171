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
