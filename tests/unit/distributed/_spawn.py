"""Run a function on N gloo ranks in spawned processes; a rank's exception fails the test with its traceback."""

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, errors: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    dist.destroy_process_group()
    # Skip interpreter finalization: about 1 run in 15, a C++ destructor at process exit aborts ("terminate called
    # without an active exception", no Python frame left) after the test has passed. Results are already checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> None:
    """Call `fn(rank, world_size, *args)` on every rank of a fresh gloo group; `fn` must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        try:
            mp.start_processes(
                _worker, args=(world_size, os.path.join(tmp, "init"), fn, args, errors),
                nprocs=world_size, start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            details = [] if errors.empty() else [errors.get()]
            raise AssertionError(f"rank failure:\n{details[0][1] if details else exc}") from None
