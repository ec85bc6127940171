"""Preflight rejects validation batches the job cannot run and W&B logging without its package, in one line each."""

import importlib.util

import pytest

from torchtitan.config import ConfigError
from torchtitan.preflight import check_job

DEBUG_TOML = ["--job.config_file", "train_configs/deepseek_v3_debugmodel.toml"]
VALIDATION = ["--validation.enable"]


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        (["--validation.seq_len", "5000"], 1, "validation.seq_len <= the model's max_seq_len 4096"),
        (["--parallelism.pipeline_parallel_degree", "2", "--validation.local_batch_size", "4"], 2,
         "validation.local_batch_size a multiple of the pipeline's 8 micro-batches"),
        (["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_parallel_overlap",
          "--validation.local_batch_size", "3"], 2, "an even validation.local_batch_size"),
        (["--validation.dataset_path", "missing.jsonl"], 1, "--validation.dataset_path='missing.jsonl' does not exist"),
    ],
    ids=["seq-len-too-long", "pp-micro-batches", "odd-batch-overlap", "missing-corpus"],
)  # fmt: skip
def test_validation_batches_the_job_cannot_run_are_rejected(tmp_path, args, world_size, message):
    with pytest.raises((ConfigError, FileNotFoundError), match=message):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), *VALIDATION, *args], world_size=world_size)


def test_wandb_without_its_package_names_the_install(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_job([*DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"], world_size=1)
