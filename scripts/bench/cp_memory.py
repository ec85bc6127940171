"""Per-rank memory of long-context training with and without context parallelism, both ranks on GPU 0.

    nvidia-cuda-mps-control -d
    python scripts/bench/cp_memory.py        # writes benchmarks/results/cp_memory_<commit>.json

16B_accept at --seq-len (default 65,536) tokens, one sequence per data-parallel rank, compile + per-op SAC, EP=1,
two ranks launched by `shared_gpu.py` (gloo; memory is real, speed is not: no tokens/s here):
- cp2: CP=2, each rank holds 32,768 tokens of the sequence; FSDP over the 2 ranks;
- cp1: CP=1 (FSDP=2), each rank holds a whole 65,536-token sequence: the same per-rank batch of sequences, twice the
  tokens per rank. It may run out of memory: that is recorded (exit code, "out_of_memory"), not an error here.
Records per run rank 0's per-step losses and peak allocated GiB (`training_peak_allocated_gib` is their maximum: the
trainer resets the allocator's peak every step, so each rank's `max_allocated_gib` written at exit covers only the
end of the run; its `max_reserved_gib` is the whole run's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import REPO_ROOT, git_commit, write_result  # noqa: E402

JOB = [
    "--job.config_file", "train_configs/deepseek_v3_16b.toml", "--model.flavor", "16B_accept",
    "--parallelism.expert_parallel_degree", "1", "--parallelism.expert_parallel_comm_backend", "standard",
    "--training.local_batch_size", "1", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
    "--metrics.log_freq", "1", "--activation_checkpoint.memory_budget_gib", "0",
]  # fmt: skip
RUNS = {"cp2": ["--parallelism.context_parallel_degree", "2"], "cp1": ["--parallelism.data_parallel_shard_degree", "2"]}


def run(name: str, args: list[str], work: Path) -> dict:
    dump = work / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "scripts/bench/shared_gpu.py", *JOB, *args, "--job.dump_folder", str(dump),
    ]  # fmt: skip
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True", "SEGMENTS_OUT": str(dump / "memory")}
    log = work / f"{name}.log"
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    metrics = dump / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    peaks = [json.loads(p.read_text()) for p in sorted((dump / "memory").glob("rank*_peak.json"))]
    if code:
        print(text[-3000:])
    return {
        "args": args,
        "exit_code": code,
        "out_of_memory": "OutOfMemoryError" in text or "CUDA out of memory" in text,
        "per_rank_peak": peaks,
        "losses": [r["loss"] for r in records if "loss" in r],
        "memory_allocated_gib_per_step": [r.get("memory_allocated_gib") for r in records if "loss" in r],
        "training_peak_allocated_gib": max((r.get("memory_allocated_gib") or 0 for r in records), default=None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cp_memory_"))
    extra = ["--training.seq_len", str(opts.seq_len), "--training.steps", str(opts.steps)]
    result = {"job": [*JOB, *extra], "seq_len": opts.seq_len, "runs": {}}
    for name, args in RUNS.items():
        result["runs"][name] = run(name, [*args, *extra], work)
        print(name, json.dumps({k: v for k, v in result["runs"][name].items() if k != "losses"}), flush=True)
    print(write_result(result, f"cp_memory_{git_commit()[:7]}"))
    return result["runs"]["cp2"]["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
