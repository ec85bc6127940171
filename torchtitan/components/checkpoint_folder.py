"""The on-disk life of a checkpoint folder: atomic publish, manifest validation, discovery, crash cleanup.

    step-40/            a resumable (full) checkpoint: its files + `complete.json` (name, bytes, crc32 per file)
    step-50.tmp/        a save in progress (or interrupted); never loaded
    exports/step-60/    a model-only or HF export: weights only, never resumed from, never counted by retention

Only `publish` makes a checkpoint visible: manifest written and fsynced, then `step-N.tmp` renamed into place. Every
rank checksums the DCP files it wrote (`checksums.rank<r>.json`), which `publish` merges into the manifest; on resume
each rank verifies its share (`corrupt_files`).
"""

import json
import logging
import os
import re
import shutil
import stat
import time
import zlib
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "complete.json"
TMP_SUFFIX = ".tmp"
FORMAT_FULL = "full"
FORMAT_MODEL_ONLY = "model_only"
FORMAT_HF = "hf"
EXPORTS_DIR = "exports"
_EXPORT_FORMATS = (FORMAT_MODEL_ONLY, FORMAT_HF)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHECKSUMS = re.compile(r"^checksums\.rank(\d+)\.json$")
_CHUNK_BYTES = 16 << 20
_WAIT_S = 600.0  # how long `publish` waits for checksum files (async saves write them in the background)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the folder and the fix."""


def write_rank_checksums(tmp_path: str, rank: int) -> None:
    """Each rank, once its DCP files are written: crc32 of its own files (`__<rank>_*`; rank 0 also `.metadata`)."""
    names = [name for name in os.listdir(tmp_path) if name.startswith(f"__{rank}_")]
    if rank == 0 and os.path.isfile(os.path.join(tmp_path, ".metadata")):
        names.append(".metadata")
    sums = {name: file_crc32(os.path.join(tmp_path, name)) for name in names}
    sidecar = os.path.join(tmp_path, f"checksums.rank{rank}.json")
    with open(sidecar + TMP_SUFFIX, "w") as f:
        json.dump(sums, f)
    os.replace(sidecar + TMP_SUFFIX, sidecar)


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def publish(folder: str, step: int, tmp_path: str, fmt: str, num_ranks: int = 1) -> str:
    """Rank 0, once the checksum files of `num_ranks` ranks are there: manifest, fsync, rename `step-N.tmp` into
    place; returns the final path."""
    _wait_for_checksums(tmp_path, num_ranks if fmt != FORMAT_HF else 0)
    checksums: dict[str, str] = {}
    for name in os.listdir(tmp_path):
        if _CHECKSUMS.match(name):
            with open(os.path.join(tmp_path, name)) as f:
                checksums.update(json.load(f))
            os.remove(os.path.join(tmp_path, name))
    files = {}
    for root, _, names in os.walk(tmp_path):
        for name in names:
            full = os.path.join(root, name)
            fsync(full)
            relative = os.path.relpath(full, tmp_path)
            crc = checksums.get(relative) or file_crc32(full)  # files no rank summed: HF exports, extras
            files[relative] = {"bytes": os.path.getsize(full), "crc32": crc}
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
    return _move_into_place(folder, step, tmp_path, fmt)


def _wait_for_checksums(tmp_path: str, num_ranks: int) -> None:
    deadline = time.monotonic() + _WAIT_S
    while True:
        found = {int(m.group(1)) for m in map(_CHECKSUMS.match, os.listdir(tmp_path)) if m}
        missing = sorted(set(range(num_ranks)) - found)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"save into {tmp_path}: ranks {missing} wrote no checksums in {_WAIT_S:.0f}s")
        time.sleep(0.05)


def _final_path(folder: str, step: int, fmt: str) -> str:
    parent = folder if fmt == FORMAT_FULL else os.path.join(folder, EXPORTS_DIR)
    return os.path.join(parent, f"step-{step}")


def _move_into_place(folder: str, step: int, tmp_path: str, fmt: str) -> str:
    final_path = _final_path(folder, step, fmt)
    parent = os.path.dirname(final_path)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(final_path):
        shutil.rmtree(final_path)
    os.replace(tmp_path, final_path)
    fsync(parent)
    fsync(folder)
    return final_path


def validate_checkpoint(path: str, fix: str | None = None) -> dict[str, Any]:
    """Return the manifest of complete checkpoint `path`; raise CheckpointError if files do not match it."""
    reason = manifest_problem(path)
    if reason is not None:
        fix = fix or f"Delete {path} (or move it out of the folder) to resume from the previous checkpoint"
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {reason}. {fix}")
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return json.load(f)


def manifest_problem(path: str) -> str | None:
    manifest_path = os.path.join(path, MANIFEST_NAME)
    if not _has_manifest(path):
        return f"no {MANIFEST_NAME} (the save did not finish)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files, fmt = manifest["files"], manifest["format"]
    except PermissionError:  # healthy for all we know: the fix is the permissions, never deleting it
        raise _permission_denied(manifest_path) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST_NAME} ({err!r})"
    if fmt != FORMAT_HF and ".metadata" not in files:
        return "the manifest lists no .metadata"
    for name, entry in sorted(files.items()):
        size = entry["bytes"] if isinstance(entry, dict) else entry  # older manifests: name -> bytes
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
    return None


def corrupt_files(path: str, manifest: dict[str, Any], rank: int, num_ranks: int) -> list[str]:
    """The files of this rank's share (every num_ranks-th, in name order) whose crc32 differs from the manifest."""
    entries = sorted(manifest["files"].items())[rank::num_ranks]
    bad = []
    for name, entry in entries:
        try:
            if isinstance(entry, dict) and file_crc32(os.path.join(path, name)) != entry["crc32"]:
                bad.append(name)
        except PermissionError:
            raise _permission_denied(os.path.join(path, name)) from None
    return bad


def verify_checkpoint_files(path: str, fix: str, manifest_fix: str | None = None) -> None:
    """The scripts' check of checkpoint `path`, if it has a manifest: every file's size and crc32, as before a resume.
    `fix` ends the error (`manifest_fix` that of a size or manifest problem; default "Nothing was loaded; <fix>")."""
    if not _has_manifest(path):
        return
    manifest = validate_checkpoint(path, fix=manifest_fix or f"Nothing was loaded; {fix}")
    if bad := corrupt_files(path, manifest, rank=0, num_ranks=1):
        raise corrupt_checkpoint_error(path, bad, fix)


def corrupt_checkpoint_error(path: str, bad: list[str], fix: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is corrupt: {', '.join(bad)} no longer match(es) the checksum written with it. "
        f"Nothing was loaded; {fix}"
    )


def dcp_error_cause(err: BaseException) -> BaseException:
    """The error behind a DCP failure: a CheckpointException (a BaseException whose text is every failed rank's
    traceback) gives its first rank's error."""
    import torch.distributed.checkpoint as dcp  # here, so preflight can look at folders before torch is imported

    if isinstance(err, dcp.CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def dcp_error_text(err: BaseException) -> str:
    """One line for a DCP failure (its first rank's error)."""
    err = dcp_error_cause(err)
    return " ".join(f"{type(err).__name__}: {err}".split())


def validate_foreign_dcp(path: str, fix: str) -> bool:
    """An initial_load_path: one of ours (it has a manifest: True) has every file of its manifest at its size (its
    checksums are the caller's to verify, spread over the ranks); any DCP folder needs `.metadata`. `fix` ends the
    error of a damaged one."""
    if _has_manifest(path):
        validate_checkpoint(path, fix=f"Nothing was loaded; {fix}")
        return True
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if missing := missing_metadata(path):
            raise CheckpointError(f"checkpoint.initial_load_path {missing}; {fix}")
        raise CheckpointError(
            f"checkpoint.initial_load_path {path} is not a DCP checkpoint folder (no .metadata); for HF safetensors "
            f"set --checkpoint.initial_load_in_hf"
        )
    return False


def missing_metadata(path: str) -> str | None:
    """'<path> is a DCP checkpoint ... missing its .metadata ...' for a folder of DCP data files (`*.distcp`) without
    the `.metadata` that indexes them, else None: told apart from a folder that is no checkpoint at all."""
    if os.path.isfile(os.path.join(path, ".metadata")) or not os.path.isdir(path):
        return None
    data = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))
    if not data:
        return None
    return (
        f"{path} is a DCP checkpoint (its {data[0]}{', ...' if len(data) > 1 else ''}) missing its .metadata, which "
        "DCP writes last: an incomplete save or a damaged copy"
    )


def checkpoint_keys(path: str, fix: str = "use an intact checkpoint") -> set[str]:
    """The DCP keys of checkpoint `path`; an unreadable `.metadata` raises with `fix`."""
    return set(checkpoint_metadata(path, fix))


def checkpoint_metadata(path: str, fix: str = "use an intact checkpoint") -> dict[str, Any]:
    """The DCP metadata of checkpoint `path` by key (a tensor's gives its size)."""
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"cannot read {path}/.metadata ({dcp_error_text(err)}); {fix}") from err


def model_key_prefix(keys) -> str:
    """How a DCP checkpoint names the model's tensors: "model." under the trainer's {"model": ...} state (full
    checkpoints, scripts/convert_hf.py's output), "" at top level (a model-only export)."""
    return "model." if any(key.startswith("model.") for key in keys) else ""


def model_mismatch(ours: dict[str, Any], held: dict[str, Any], optional: tuple[str, ...] = ()) -> str | None:
    """How a checkpoint's tensors (`held`: name -> shape) are another model's than `ours`: the tensors of ours it lacks
    (but those under `optional` prefixes), else the first in another shape; None when neither. Said after
    "<checkpoint> holds another model than <shape source> builds: "."""
    if missing := [name for name in ours if name not in held and not name.startswith(optional)]:
        return f"it lacks {len(missing)} of its tensors, e.g. {missing[:3]}"
    if wrong := next((name for name in ours if name in held and tuple(held[name]) != tuple(ours[name])), None):
        return f"{wrong} is {list(held[wrong])} there, {list(ours[wrong])} here"
    return None


def is_step_name(name: str) -> bool:
    """Whether `name` is where a save goes: `step-N` or its `step-N.tmp`."""
    return _STEP_DIR.match(name.removesuffix(TMP_SUFFIX)) is not None


def _has_manifest(path: str) -> bool:
    """Whether folder `path` holds a manifest. An unreadable folder is an error, not an unfinished save (which would
    be skipped, then deleted by the save of its step)."""
    try:
        return stat.S_ISREG(os.stat(os.path.join(path, MANIFEST_NAME)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError:
        raise _permission_denied(f"checkpoint {path}", f", or move it out of {os.path.dirname(path)}") from None


def _permission_denied(what: str, or_else: str = "") -> CheckpointError:
    return CheckpointError(f"cannot read {what} (permission denied): fix its permissions{or_else}")


def complete_checkpoints(folder: str) -> dict[int, str]:
    """{step: path} of the resumable `step-N` folders that have a manifest (validated when loaded). Exports are not
    among them: they live in `exports/` (an older layout's top-level export is told apart by its manifest's format)."""
    complete = {}
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        path = os.path.join(folder, name)
        # an unreadable manifest stays a candidate, so loading it reports the damage instead of skipping it
        if match and _has_manifest(path) and _format(path) not in _EXPORT_FORMATS:
            complete[int(match.group(1))] = path
    return complete


def unfinished_checkpoints(folder: str) -> list[str]:
    """`step-N` folders without a manifest: a save that never finished, or a deleted `complete.json`."""
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if _STEP_DIR.match(name) and not _has_manifest(os.path.join(folder, name))
    )


def exports(folder: str) -> list[str]:
    """Export folders (model-only / HF), newest last: `exports/step-N` and older top-level ones."""
    found = []
    exports_dir = os.path.join(folder, EXPORTS_DIR)
    for parent in filter(os.path.isdir, (folder, exports_dir)):
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if (match := _STEP_DIR.match(name)) and _has_manifest(path):
                if parent == exports_dir or _format(path) in _EXPORT_FORMATS:
                    found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _format(path: str) -> str | None:
    try:
        with open(os.path.join(path, MANIFEST_NAME)) as f:
            return json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_tmp_folders(folder: str) -> None:
    """Startup, rank 0: finish renames that a crash interrupted after the manifest; delete other `.tmp` folders."""
    for name in sorted(os.listdir(folder)):
        match = _STEP_DIR.match(name.removesuffix(TMP_SUFFIX))
        if not (name.endswith(TMP_SUFFIX) and match):
            continue
        tmp_path, step = os.path.join(folder, name), int(match.group(1))
        complete = manifest_problem(tmp_path) is None
        fmt = _format(tmp_path) if complete else None
        if complete and not os.path.exists(_final_path(folder, step, fmt)):
            logger.warning(f"{tmp_path} is complete but was not moved into place (crash); finishing that")
            _move_into_place(folder, step, tmp_path, fmt)
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
