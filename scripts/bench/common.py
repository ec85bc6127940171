"""What every benchmark result records: the exact command, device, torch version and git commit."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Dense bf16 matmul rate measured on an H200 of our device pool (8192^3 bf16 matmul, random data).
MEASURED_H200_BF16_TFLOPS = 790.0


def git_commit() -> str:
    """$GIT_COMMIT when set (device copies of the tree may carry a stale .git), else the checkout's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    return {
        "torch_version": torch.__version__,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count(),
        "git_commit": git_commit(),
        "command": os.environ.get("BENCH_COMMAND") or shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_result(result: dict, name: str, out_dir: Path | None = None) -> Path:
    """Write one JSON per run; `out_dir` defaults to $BENCH_OUT, then benchmarks/results/."""
    out_dir = Path(out_dir or os.environ.get("BENCH_OUT") or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({**environment(), **result}, indent=2) + "\n")
    return path


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cuda_time_ms(fn, warmup: int, iters: int, barrier: bool = False) -> float:
    """Median milliseconds of `fn()` by CUDA events after `warmup` calls; `barrier` lines ranks up per iteration."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if barrier:
            dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def time_ms(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of `fn()`: CUDA events on a GPU, the host clock on CPU (gloo smoke runs only)."""
    if device.type == "cuda":
        return cuda_time_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def init_process_group_from_torchrun() -> torch.device:
    """This torchrun rank's GPU with NCCL (`init_nccl_from_torchrun`), or the CPU with gloo where there is no GPU."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        return init_nccl_from_torchrun()
    dist.init_process_group("gloo")
    return torch.device("cpu")


def init_nccl_from_torchrun() -> torch.device:
    """This torchrun rank's GPU, with the default NCCL process group bound to it."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    return device


def profile_summary(fn, iters: int = 3, top: int = 25) -> list[dict]:
    """torch.profiler over `iters` calls of `fn()`, the device synchronized before and after (every kernel in the window
    is one of theirs): the `top` ops and kernels by self device time, per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # outside the trace: lazy init, autotuning
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [
        {
            "name": e.key[:160],
            "ms_per_step": e.self_device_time_total / 1e3 / iters,
            "calls_per_step": e.count / iters,
            "pct": 100.0 * e.self_device_time_total / total,
            "time": "device",
        }
        for e in events[:top]
    ]
