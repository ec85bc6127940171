"""Run a function on N gloo ranks in fresh processes (forked from `tests.forkserver`); a rank's exception fails the
test with its traceback."""

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.forkserver import CONTEXT, adopt_environment
from tests.timeouts import generous_timeout
from torchtitan.distributed.utils import destroy_process_groups


def _worker(rank: int, world_size: int, environ: dict, init_file: str, fn: Callable, args: tuple, errors: Any) -> None:
    adopt_environment({**environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}, 1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # Free the groups while the interpreter is alive, as the trainer does, so a crash at exit fails the test.
    destroy_process_groups()


HANG_TIMEOUT_S = 900.0
"""Seconds on an idle machine after which the ranks count as hung (the slowest test's ranks take about a minute)."""


def run_distributed(fn: Callable, world_size: int, *args: Any) -> None:
    """Call `fn(rank, world_size, *args)` on every rank of a fresh gloo group; `fn` must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        errors = CONTEXT.SimpleQueue()
        ranks = mp.start_processes(
            _worker,
            args=(world_size, dict(os.environ), os.path.join(tmp, "init"), fn, args, errors),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        limit = generous_timeout(HANG_TIMEOUT_S)
        deadline = time.monotonic() + limit
        try:
            while not ranks.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in ranks.processes:
                        process.kill()
                    raise AssertionError(f"ranks still running after {limit:.0f} s: a hang")
        except mp.ProcessRaisedException as exc:
            details = [] if errors.empty() else [errors.get()]
            raise AssertionError(f"rank failure:\n{details[0][1] if details else exc}") from None
