"""Rank processes for the multi-process tests, forked from one server that has imported torch and torchtitan.

A freshly spawned rank spends 4-8 CPU-seconds importing torch, torchtitan and the compile stack before it runs a
line of its test, and the suite starts ~200 ranks: on two cores that was most of its time. multiprocessing's
forkserver imports those modules once (`set_forkserver_preload`) and forks every rank from that state, so each rank
is still a fresh process (no state shared between tests) without the import. The server only imports: no tensor
work, no thread pool, no CUDA context exists in it to be forked, which is what makes fork safe with PyTorch.
"""

import multiprocessing
import os

import torch

PRELOAD = [
    "pytest",
    "torchtitan.train",
    # what torch imports lazily on a rank's first compile, FSDP or pipeline use
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.testing",
]

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


def adopt_environment(environ: dict[str, str], threads: int) -> None:
    """Make a forked rank see the caller's environment (the server's is the one it started with) and use `threads`
    CPU threads (OMP_NUM_THREADS is read at torch's import, which happened in the server)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
