"""End-to-end training benchmark: run the trainer through run_train.sh, keep steady-state steps only.

    python scripts/bench/e2e.py --name 16b_ep4_deepep_compile --ngpu 4 --warmup-steps 5 -- \
        --model.flavor 16B_bench4 --parallelism.expert_parallel_degree 4 ...

Writes benchmarks/results/e2e_<name>.json (or $BENCH_OUT) with median tokens/s per GPU, TFLOPS, MFU,
peak memory, the losses, the graphs torch.compile compiled per step (recompiles after warm-up should be 0) and the
routing ("natural": the router's own; "balanced": forced round-robin), read from the run's metrics.jsonl.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import REPO_ROOT, median, write_result  # noqa: E402
from torchtitan.tools.profiling import MIN_PROFILE_FREQ  # noqa: E402


def run_settings(config_file: str, train_args: list[str], ngpu: int) -> dict:
    """The settings a run resolves to (TOML < CLI), as explicit result fields."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3 import get_model_args

    job = ConfigManager().parse_args(["--job.config_file", config_file, *train_args])
    par = job.parallelism
    dims = ParallelDims.from_config(par, ngpu)  # resolves dp_shard = -1
    return {
        "model_flavor": job.model.flavor,
        "parallel": {name: getattr(dims, name) for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "etp")},
        "ep_backend": par.expert_parallel_comm_backend,
        "ep_overlap": par.expert_parallel_overlap,
        "deepep_sync_free_dispatch": par.deepep_sync_free_dispatch,
        "mtp_layers": get_model_args(job).mtp_layers,
        "float8_experts": job.quantize.float8_experts,
        "float8_linears": job.quantize.float8_linears,
        "float8_dispatch": job.quantize.float8_dispatch,
        "compile": job.compile.enable,
        "activation_checkpoint": job.activation_checkpoint.mode
        + (
            f":{job.activation_checkpoint.selective_ac_option}" if job.activation_checkpoint.mode == "selective" else ""
        ),
        "tokens_per_gpu_per_step": job.training.local_batch_size * job.training.seq_len,
        "routing": "balanced" if job.debug.moe_force_load_balance else "natural",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--config", default="./train_configs/deepseek_v3_16b.toml")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps dropped (compile, allocator warm-up)")
    parser.add_argument(
        "--profile-step", type=int, default=0, help="record this step with torch.profiler, add rank 0's op summary"
    )
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]

    dump = Path(tempfile.mkdtemp(prefix=f"bench_{args.name}_"))
    env = {**os.environ, "CONFIG_FILE": args.config, "NGPU": str(args.ngpu), "LOG_RANK": "0"}
    profiling = []
    if args.profile_step:
        profiling = ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.profile_step)]
    cmd = ["bash", "run_train.sh", "--job.dump_folder", str(dump), "--metrics.log_freq", "1", *train_args, *profiling]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall_s = time.time() - start
    log_tail = (proc.stdout + proc.stderr)[-6000:]
    result = {
        "name": args.name,
        "ngpu": args.ngpu,
        **run_settings(args.config, train_args, args.ngpu),
        "train_args": train_args,
        "returncode": proc.returncode,
        "wall_s": round(wall_s, 1),
    }
    command = f"CONFIG_FILE={args.config} NGPU={args.ngpu} ./run_train.sh " + shlex.join(train_args)
    os.environ["BENCH_COMMAND"] = command
    if proc.returncode != 0:
        result["error_log_tail"] = log_tail
        write_result(result, f"e2e_{args.name}")
        print(log_tail)
        sys.exit(proc.returncode)

    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    # the profiler traces the recorded step and its warm-up steps before it: slower, not steady-state steps
    traced = range(args.profile_step - MIN_PROFILE_FREQ + 1, args.profile_step + 1) if args.profile_step else range(0)
    steady = [r for r in records if r["step"] > args.warmup_steps and r["step"] not in traced]
    if not steady:
        sys.exit(f"no steady-state steps: ran {len(records)} steps, warm-up drops {args.warmup_steps}")
    result.update(
        steps=len(records),
        steady_steps=len(steady),
        tokens_per_sec_per_gpu=median([r["tps"] for r in steady]),
        tflops_per_gpu=median([r["tflops"] for r in steady]),
        mfu_pct=median([r["mfu"] for r in steady]),
        peak_memory_gib=max(r["memory_gib"] for r in steady),
        peak_memory_allocated_gib=max(r["memory_allocated_gib"] for r in steady),
        last_loss=records[-1]["loss"],
        losses=[r["loss"] for r in records],
        mtp_losses=[r["mtp_loss"] for r in records if "mtp_loss" in r],
        graphs_compiled_per_step=[r.get("graphs_compiled", 0) for r in records],
        recompiles_after_warmup=sum(r.get("graphs_compiled", 0) for r in records if r["step"] > args.warmup_steps),
    )
    if args.profile_step:
        summary = dump / "profile_traces" / f"iteration_{args.profile_step}" / "rank0_summary.json"
        result["profile_rank0"] = json.loads(summary.read_text())
    path = write_result(result, f"e2e_{args.name}")
    keys = (
        "name",
        "tokens_per_sec_per_gpu",
        "mfu_pct",
        "peak_memory_gib",
        "peak_memory_allocated_gib",
        "recompiles_after_warmup",
        "wall_s",
    )
    print(json.dumps({k: result[k] for k in keys}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
