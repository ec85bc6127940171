"""Read and write Hugging Face safetensors folders (sharded, with model.safetensors.index.json)."""

import contextlib
import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def hf_safetensors_keys(folder: str) -> list[str]:
    """The tensor names of a HF folder: its index json's, else read from the shards' headers (no tensor is loaded)."""
    return list(weight_map(folder))


def weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> shard path: from the folder's index json (each shard it names must be there; none is opened),
    else from the headers of every *.safetensors file."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                names = dict(json.load(f)["weight_map"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # not JSON, or no {"weight_map": {...}}
            raise ValueError(f"{index_path} is not a safetensors index ({err!r}): fetch the folder again") from None
        files = sorted(set(names.values()))
        if missing := [name for name in files if not os.path.isfile(os.path.join(folder, name))]:
            raise FileNotFoundError(
                f"{index_path} names {len(missing)} shard(s) missing from the folder, e.g. {missing[0]}: an "
                "interrupted download? fetch or convert it again"
            )
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder}")
        return {name: os.path.join(folder, file) for name, file in names.items()}
    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    located = {}
    for name in files:
        path = os.path.join(folder, name)
        with reading_shard(path), safe_open(path, framework="pt") as shard:
            located.update(dict.fromkeys(shard.keys(), path))
    return located


class DamagedTensorError(ValueError):
    """A tensor read intact from its shard whose values cannot be right (e.g. an FP8 block scale of 0, NaN, inf or
    below 0): its message names the tensor and the fix, and `reading_shard` passes it on as it is."""


@contextlib.contextmanager
def reading_shard(path: str) -> Iterator[None]:
    """A shard that cannot be read is one error naming it (safetensors raises its own type for a damaged file)."""
    try:
        yield
    except DamagedTensorError:
        raise
    except Exception as err:
        index = os.path.join(os.path.dirname(path), INDEX_FILE)
        listed = f" (listed in {index})" if os.path.exists(index) else ""
        fix = "fix its permissions" if isinstance(err, PermissionError) else "truncated? fetch or convert it again"
        raise ValueError(f"cannot read shard {path}{listed} ({err}): {fix}") from None


def save_hf_safetensors(
    state_dict: dict[str, torch.Tensor], folder: str, max_shard_size: int | str = "5GB"
) -> list[str]:
    """Write `state_dict` as shards of at most max_shard_size bytes (int, or "5GB" / "500MB"; a larger tensor gets a
    shard of its own) plus the index json; returns the shard file names."""
    max_bytes = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        shard_bytes += nbytes

    os.makedirs(folder, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        # clone: safetensors refuses tensors that share storage (e.g. experts unstacked from one 3D tensor)
        shard = {k: v.detach().cpu().clone() for k, v in shard.items()}
        path = os.path.join(folder, name)
        save_file(shard, path, metadata={"format": "pt"})
        os.chmod(path, _FILE_MODE)  # safetensors writes 0600; an export is read by others, like the index json
        weight_map.update(dict.fromkeys(shard, name))
    total_size = sum(t.numel() * t.element_size() for t in state_dict.values())
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    return names


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()
"""The mode open() gives a new file under this process's umask."""


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "10KB" (powers of 1000, as HF uses)."""
    if isinstance(size, int):
        number = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", size.upper())
        if match is None:
            raise ValueError(f"max_shard_size {size!r}: use a number of bytes or a size like '5GB' or '500MB'")
        value, unit = match.groups()
        number = int(float(value) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit or "B"])
    if number <= 0:
        raise ValueError(f"max_shard_size {size!r}: must be more than 0 bytes, e.g. '5GB'")
    return number
