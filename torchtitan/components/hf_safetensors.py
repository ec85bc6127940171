"""Read and write Hugging Face safetensors folders (sharded, with model.safetensors.index.json)."""

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
INCOMPLETE_FIX = "rerun scripts/convert_hf.py to-hf into a new folder, or fetch the folder again"
"""What to do about a folder that an interrupted export or download left incomplete."""
_SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors")
"""A shard of a sharded save (ours, transformers'), whose index is written after every shard."""


def hf_safetensors_keys(folder: str) -> list[str]:
    """The tensor names of a HF folder: its index json's, else read from the shards' headers (no tensor is loaded)."""
    return list(weight_map(folder))


def weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> shard path: from the folder's index json (each shard it names must be there; none is opened),
    else from the headers of every *.safetensors file (shards of a sharded save without their index: an incomplete
    folder, FileNotFoundError)."""
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
                f"{index_path} names {len(missing)} shard(s) missing from the folder, e.g. {missing[0]}: the folder is "
                f"incomplete (an interrupted export or download); {INCOMPLETE_FIX}"
            )
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder}")
        return {name: os.path.join(folder, file) for name, file in names.items()}
    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    if shards := [name for name in files if _SHARD_NAME.fullmatch(name)]:
        raise FileNotFoundError(
            f"{folder} holds {len(shards)} shard(s) ({shards[0]}, ...) but not their {INDEX_FILE}, which is written "
            f"after every shard: the folder is incomplete (an interrupted export or download); {INCOMPLETE_FIX}"
        )
    located = {}
    for name in files:
        path = os.path.join(folder, name)
        with reading_shard(path), safe_open(path, framework="pt") as shard:
            located.update(dict.fromkeys(shard.keys(), path))
    return located


class DamagedCheckpointError(ValueError):
    """A folder whose files read intact but do not fit together (an index listing a tensor its shard lacks) or hold
    values that cannot be right (an FP8 block scale of 0, NaN, inf or below 0): its message names what and the fix,
    and `reading_shard` passes it on as it is."""


@contextlib.contextmanager
def reading_shard(path: str) -> Iterator[None]:
    """A shard that cannot be read is one error naming it (safetensors raises its own type for a damaged file)."""
    try:
        yield
    except DamagedCheckpointError:
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
    shard of its own) plus the index json; returns the shard file names. A write that fails (a full disk, no
    permission) is an OSError with its errno, whichever library wrote (`export_write_problem` says it in a line)."""
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
        save_safetensors_file(shard, os.path.join(folder, name))
        weight_map.update(dict.fromkeys(shard, name))
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": export_bytes(state_dict)}, "weight_map": weight_map}, f, indent=2)
    return names


def save_safetensors_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    """One safetensors file of `tensors` (contiguous, sharing no storage), readable as any new file is (safetensors
    writes 0600; an export is read by others); a write that fails is an OSError with its errno."""
    _save_file(tensors, path)
    os.chmod(path, _FILE_MODE)


def export_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """The bytes `save_hf_safetensors` writes for `state_dict`, to within its headers and index."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())


def export_write_problem(folder: str, err: OSError, needed: int, elsewhere: str) -> str:
    """Why writing an export of `needed` bytes into `folder` failed with `err`, and the fix, for a one-line error: a
    full disk names the space the export needs and the space free there; `elsewhere` says how to write it elsewhere."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        existing = os.path.abspath(folder)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            free = f", {_size(shutil.disk_usage(existing).free)} are free there"
        except OSError:
            free = ""
        return f"{reason} in {folder}: the export needs {_size(needed)}{free}; free the space, or {elsewhere}"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{folder} cannot be written ({reason}); make it writable, or {elsewhere}"
    return f"writing into {folder} failed ({reason}); {elsewhere}"


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _save_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, whose I/O errors ("... (os error 28)" in a SafetensorError) become the OSError open()
    raises."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as err:
        if (code := re.search(r"\(os error (\d+)\)", str(err))) is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None


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
