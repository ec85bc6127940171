"""Whole HF safetensors folders in memory, for tests that look at what was written (the package reads only the part
a process needs: `hf_checkpoint.HFCheckpoint`)."""

import os

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from torchtitan.components import hf_safetensors
from torchtitan.components.hf_safetensors import reading_shard, weight_map


def load_hf_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder as they are stored (FP8 weights and their scales too): the shards named by its index
    json, or every *.safetensors file without one."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in sorted(set(weight_map(folder).values())):
        with reading_shard(path):
            state_dict.update(load_file(path))
    return state_dict


def fail_hf_writes(monkeypatch: pytest.MonkeyPatch, errno_code: int, where: str) -> None:
    """Writes of an HF export fail with `errno_code` (ENOSPC: a full disk): a shard's as safetensors raises it (a
    SafetensorError naming the OS error), or (`where` "index") the index json's as open() raises it (an OSError)."""
    if where == "shard":

        def save_file(tensors, path, metadata=None):
            raise SafetensorError(
                f"Error while serializing: I/O error: {os.strerror(errno_code)} (os error {errno_code})"
            )

        monkeypatch.setattr(hf_safetensors, "save_file", save_file)
        return
    real_open = open

    def index_open(path, *args, **kwargs):
        if str(path).endswith(hf_safetensors.INDEX_FILE):
            raise OSError(errno_code, os.strerror(errno_code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(hf_safetensors, "open", index_open, raising=False)
