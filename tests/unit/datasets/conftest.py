import json
from pathlib import Path

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_TOKENIZER = REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json"

DOCUMENTS = [
    "It is a truth universally acknowledged.",
    "Emma Woodhouse, handsome, clever, and rich.",
    "The family of Dashwood had long been settled in Sussex.",
    "No one who had ever seen Catherine Morland in her infancy.",
]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc, "id": i}) + "\n" for i, doc in enumerate(DOCUMENTS)))
    return path


@pytest.fixture
def documents() -> list[str]:
    return list(DOCUMENTS)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def make_job_config():
    """Factory: JobConfig(dataset_path=None, seq_len=16, local_batch_size=2)."""

    def make(dataset_path: Path | str | None = None, seq_len: int = 16, local_batch_size: int = 2) -> JobConfig:
        job_config = JobConfig()
        job_config.training.dataset_path = None if dataset_path is None else str(dataset_path)
        job_config.training.seq_len = seq_len
        job_config.training.local_batch_size = local_batch_size
        return job_config

    return make
