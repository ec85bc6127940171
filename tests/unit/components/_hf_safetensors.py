"""Whole HF safetensors folders in memory, for tests that look at what was written (the package reads only the part
a process needs: `hf_checkpoint.HFCheckpoint`)."""

import torch
from safetensors.torch import load_file

from torchtitan.components.hf_safetensors import reading_shard, weight_map


def load_hf_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder as they are stored (FP8 weights and their scales too): the shards named by its index
    json, or every *.safetensors file without one."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in sorted(set(weight_map(folder).values())):
        with reading_shard(path):
            state_dict.update(load_file(path))
    return state_dict
