"""The on-disk life of a checkpoint folder: atomic publish, manifest validation, discovery, crash cleanup.

    step-40/            a complete checkpoint: its files + `complete.json` (file names and sizes)
    step-50.tmp/        a save in progress (or interrupted); never loaded

Only `publish` makes a checkpoint visible: manifest written and fsynced, then `step-N.tmp` renamed to `step-N`.
"""

import json
import logging
import os
import re
import shutil
import time
from typing import Any

import torch.distributed.checkpoint as dcp

logger = logging.getLogger(__name__)

MANIFEST_NAME = "complete.json"
TMP_SUFFIX = ".tmp"
FORMAT_FULL = "full"
FORMAT_MODEL_ONLY = "model_only"
FORMAT_HF = "hf"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the folder and the fix."""


def publish(folder: str, step: int, tmp_path: str, fmt: str) -> str:
    """Rank 0, after every rank wrote: manifest, fsync, rename `step-N.tmp` -> `step-N`; returns the final path."""
    files = {}
    for root, _, names in os.walk(tmp_path):
        for name in names:
            full = os.path.join(root, name)
            fsync(full)
            files[os.path.relpath(full, tmp_path)] = os.path.getsize(full)
    if fmt != FORMAT_HF and ".metadata" not in files:
        raise CheckpointError(f"save into {tmp_path} produced no .metadata; not publishing it")
    manifest = {"step": step, "format": fmt, "files": files, "time": time.time()}
    manifest_tmp = os.path.join(tmp_path, MANIFEST_NAME + TMP_SUFFIX)
    with open(manifest_tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(manifest_tmp, os.path.join(tmp_path, MANIFEST_NAME))
    fsync(tmp_path)
    final_path = os.path.join(folder, f"step-{step}")
    if os.path.exists(final_path):
        shutil.rmtree(final_path)
    os.replace(tmp_path, final_path)
    fsync(folder)
    return final_path


def validate_checkpoint(path: str) -> dict[str, Any]:
    """Return the manifest of complete checkpoint `path`; raise CheckpointError if files do not match it."""
    reason = manifest_problem(path)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt: {reason}. Delete {path} to resume from the previous "
            f"checkpoint, or choose another with --checkpoint.load_step"
        )
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return json.load(f)


def manifest_problem(path: str) -> str | None:
    manifest_path = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        return f"no {MANIFEST_NAME} (the save did not finish)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files, fmt = manifest["files"], manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST_NAME} ({err!r})"
    if fmt != FORMAT_HF and ".metadata" not in files:
        return "the manifest lists no .metadata"
    for name, size in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
    return None


def validate_foreign_dcp(path: str) -> None:
    """An initial_load_path: one of ours (manifest) is fully validated; any DCP folder needs `.metadata`."""
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        validate_checkpoint(path)
    elif not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"checkpoint.initial_load_path {path} is not a DCP checkpoint folder (no .metadata); for HF safetensors "
            f"set --checkpoint.initial_load_in_hf"
        )


def checkpoint_keys(path: str) -> set[str]:
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as err:
        raise CheckpointError(
            f"cannot read {path}/.metadata ({err!r}); delete {path} or choose another with --checkpoint.load_step"
        ) from err


def complete_checkpoints(folder: str) -> dict[int, str]:
    """{step: path} of `step-N` folders that have a manifest (validated when loaded)."""
    complete = {}
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        path = os.path.join(folder, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            complete[int(match.group(1))] = path
    return complete


def resolve_tmp_folders(folder: str) -> None:
    """Startup, rank 0: finish renames that a crash interrupted after the manifest; delete other `.tmp` folders."""
    for name in sorted(os.listdir(folder)):
        if not (name.endswith(TMP_SUFFIX) and _STEP_DIR.match(name[: -len(TMP_SUFFIX)])):
            continue
        tmp_path = os.path.join(folder, name)
        final_path = tmp_path[: -len(TMP_SUFFIX)]
        if manifest_problem(tmp_path) is None and not os.path.exists(final_path):
            logger.warning(f"{tmp_path} is complete but was not renamed (crash); renaming it to {final_path}")
            os.replace(tmp_path, final_path)
        else:
            logger.warning(f"removing {tmp_path}: a save that did not finish")
            shutil.rmtree(tmp_path, ignore_errors=True)
    fsync(folder)


def fsync(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
