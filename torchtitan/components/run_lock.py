"""One trainer per dump folder, and no trainer outliving its launcher.

The lock is an advisory `flock` on `<dump_folder>/.trainer.lock`, held by global rank 0 for the whole run; the
kernel drops it when that process dies, however it dies, so a crashed run never leaves a stale lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
from typing import IO

LOCK_NAME = ".trainer.lock"
_PR_SET_PDEATHSIG = 1


class DumpFolderBusyError(RuntimeError):
    """Another live training run holds the dump folder."""


def acquire_dump_folder(dump_folder: str) -> IO[str]:
    """Lock `dump_folder` for this process; keep the returned file open for as long as the run lasts."""
    os.makedirs(dump_folder, exist_ok=True)
    lock_file = open(os.path.join(dump_folder, LOCK_NAME), "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "unknown"
        lock_file.close()
        raise DumpFolderBusyError(
            f"another training run (pid {holder}) is using --job.dump_folder {dump_folder}; wait for it to end, "
            "stop it, or choose another --job.dump_folder"
        ) from None
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"{os.getpid()}\n")
    lock_file.flush()
    return lock_file


def check_dump_folder_free(dump_folder: str) -> None:
    """Preflight: raise DumpFolderBusyError now rather than after torchrun started the workers."""
    acquire_dump_folder(dump_folder).close()


def exit_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (torchrun's agent) dies, e.g. on `kill -9` of the
    launcher: torchrun starts workers in their own session, where a signal to the launcher's group misses them."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
