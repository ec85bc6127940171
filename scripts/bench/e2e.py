"""End-to-end training benchmark: run the trainer through run_train.sh, keep steady-state steps only.

    python scripts/bench/e2e.py --name 16b_ep4_deepep_compile --ngpu 4 --warmup-steps 5 -- \
        --model.flavor 16B_bench4 --parallelism.expert_parallel_degree 4 ...

Writes benchmarks/results/e2e_<name>.json (or $BENCH_OUT) with median tokens/s per GPU, TFLOPS, MFU,
peak memory, the losses, the graphs torch.compile compiled per step (recompiles after warm-up should be 0) and the
routing ("natural": the router's own; "balanced": forced round-robin), read from the run's metrics.jsonl, and whether
the step ran as a CUDA graph (`cuda_graphs`, with the log's lines about capture in `cuda_graph_log`). With
`--profile-step N`: rank 0's summary of step N (`profile_rank0`), its kernels by class (`profile_breakdown`,
scripts/bench/trace_breakdown.py) and every rank's compute, exposed communication, waiting for other ranks and idle
time (`profile_ranks`, scripts/bench/rank_profile.py). $BENCH_TRACES names a folder to copy the traces into.

A run measures the activation checkpointing its arguments name: the job's memory budget (the 16B job sets one) is
off unless `--activation_checkpoint.memory_budget_gib` is among them.
"""

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import REPO_ROOT, median, write_result  # noqa: E402
from scripts.bench.rank_profile import markdown_table as rank_table  # noqa: E402
from scripts.bench.rank_profile import rank_profile, read_traces  # noqa: E402
from scripts.bench.trace_breakdown import breakdown, markdown_table  # noqa: E402
from torchtitan.tools.profiling import MIN_PROFILE_FREQ  # noqa: E402


def run_settings(config_file: str, train_args: list[str], ngpu: int) -> dict:
    """The settings a run resolves to (TOML < CLI), as explicit result fields."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.moe.exchange import resolve_exchange
    from torchtitan.models.spec import get_model_spec

    job = ConfigManager().parse_args(["--job.config_file", config_file, *train_args])
    par = job.parallelism
    dims = ParallelDims.from_config(par, ngpu)  # resolves dp_shard = -1
    exchange = resolve_exchange(job)
    return {
        "model_flavor": job.model.hf_config_path or job.model.flavor,  # the shape's source: the config wins
        "parallel": {name: getattr(dims, name) for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "etp")},
        "ep_backend": exchange.name,
        "exchange": dataclasses.asdict(exchange),  # the backend's own settings, as it holds them
        "expert_parallel_capacity_factor": par.expert_parallel_capacity_factor,
        "mtp_layers": get_model_spec(job.model.name).model_args(job).mtp_layers,
        "float8_experts": job.quantize.float8_experts,
        "float8_linears": job.quantize.float8_linears,
        "compile": job.compile.enable,
        "cuda_graphs": job.compile.cuda_graphs,
        "activation_checkpoint": job.activation_checkpoint.mode
        + (
            f":{job.activation_checkpoint.selective_ac_option}" if job.activation_checkpoint.mode == "selective" else ""
        ),
        "memory_budget_gib": job.activation_checkpoint.memory_budget_gib,
        "moments_dtype": job.optimizer.moments_dtype,
        "tokens_per_gpu_per_step": job.training.local_batch_size * job.training.seq_len,
        "routing": "balanced" if job.debug.moe_force_load_balance else "natural",
    }


def cuda_graph_lines(output: str) -> list[str]:
    """The log lines about CUDA graphs: the trainer's capture (compile.cuda_graphs) or its failure, and inductor's
    cudagraph decisions ("skipping cudagraphs due to ...")."""
    keys = ("cuda_graphs", "CUDA graph", "cudagraph")
    return [line.strip()[-400:] for line in output.splitlines() if any(key in line for key in keys)][:20]


def train_and_measure(
    name: str,
    ngpu: int,
    config: str,
    train_args: list[str],
    warmup_steps: int,
    profile_step: int = 0,
    dump: Path | None = None,
) -> dict:
    """Run one training job through run_train.sh and summarise its metrics.jsonl (steps after its first
    `warmup_steps`).

    `dump` is the job's dump folder (a fresh temporary one by default); on failure the result holds
    `returncode` != 0 and `error_log_tail`."""
    dump = dump or Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    if not any(arg.startswith("--activation_checkpoint.memory_budget_gib") for arg in train_args):
        train_args = [*train_args, "--activation_checkpoint.memory_budget_gib", "0"]
    env = {**os.environ, "CONFIG_FILE": config, "NGPU": str(ngpu), "LOG_RANK": "0"}
    profiling = []
    if profile_step:
        profiling = ["--profiling.enable_profiling", "--profiling.profile_freq", str(profile_step)]
    cmd = ["bash", "run_train.sh", "--job.dump_folder", str(dump), "--metrics.log_freq", "1", *train_args, *profiling]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    result = {
        "name": name,
        "ngpu": ngpu,
        **run_settings(config, train_args, ngpu),
        "config_file": config,
        "train_args": train_args,
        "command": f"CONFIG_FILE={config} NGPU={ngpu} ./run_train.sh " + shlex.join(train_args),
        "returncode": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "cuda_graph_log": cuda_graph_lines(proc.stdout + proc.stderr),
    }
    if proc.returncode != 0:
        result["error_log_tail"] = (proc.stdout + proc.stderr)[-6000:]
        return result

    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in logged if "loss" in r]  # training steps; validation passes have records of their own
    validation = [r for r in logged if "validation/loss" in r]
    # the profiler traces the recorded step and its warm-up steps before it: slower, not steady-state steps
    traced = range(profile_step - MIN_PROFILE_FREQ + 1, profile_step + 1) if profile_step else range(0)
    # warm-up counts from the launch's first step (a resumed run starts past step 1)
    warm = records[0]["step"] - 1 + warmup_steps if records else warmup_steps
    steady = [r for r in records if r["step"] > warm and r["step"] not in traced]
    if not steady:
        result.update(returncode=1, error_log_tail=f"no steady-state steps: ran {len(records)}, warm-up {warmup_steps}")
        return result

    def summary(key: str, reduce) -> float | None:  # None where the run has no such number (CPU: no MFU)
        values = [r.get(key) for r in steady]
        return None if None in values else reduce(values)

    result.update(
        steps=len(records),
        steady_steps=len(steady),
        tokens_per_sec_per_gpu=summary("tps", median),
        tflops_per_gpu=summary("tflops", median),
        mfu_pct=summary("mfu", median),
        peak_memory_gib=summary("memory_gib", max),
        peak_memory_allocated_gib=summary("memory_allocated_gib", max),
        last_loss=records[-1]["loss"],
        loss_steps=[r["step"] for r in records],
        losses=[r["loss"] for r in records],
        tokens_per_sec_steps=[r.get("tps") for r in records],  # every logged step's, the warm-up's too
        mtp_losses=[r["mtp_loss"] for r in records if "mtp_loss" in r],
        # per steady step, the busiest EP rank's token copies over the mean, worst MoE layer (None without EP)
        ep_load_imbalance_max=summary("ep_load_imbalance_max", median),
        # the steady steps' share of routed token copies dropped at the capacity factor (None without one)
        dropped_fraction=summary("dropped_fraction", median),
        graphs_compiled_per_step=[r.get("graphs_compiled", 0) for r in records],
        recompiles_after_warmup=sum(r.get("graphs_compiled", 0) for r in records if r["step"] > warm),
    )
    output = (proc.stdout + proc.stderr).splitlines()
    plan = [line for line in output if "activation_checkpoint.memory_budget_gib=" in line]
    if plan:  # the levels the memory budget chose after the first and the second step, as the trainer logged them
        result["memory_budget_plan"] = [line[line.index("activation_checkpoint.") :] for line in plan]
    rms_groups = sorted({key for r in records for key in r if key.startswith("update_rms/")})
    if rms_groups:  # --metrics.log_update_rms: per logged step, Adam's update RMS per parameter group
        result["update_rms"] = {key.removeprefix("update_rms/"): [r.get(key) for r in records] for key in rms_groups}
        result["update_rms_lr"] = [r["lr"] for r in records]  # the lr of each logged step, to weight them by
    if validation:
        result.update(
            validation_steps=[r["step"] for r in validation],
            validation_losses=[r["validation/loss"] for r in validation],
            validation_seconds=[r["validation/seconds"] for r in validation],
        )
    if profile_step:
        traces = dump / "profile_traces" / f"iteration_{profile_step}"
        result["profile_rank0"] = json.loads((traces / "rank0_summary.json").read_text())
        result["profile_breakdown"] = breakdown(json.loads((traces / "rank0_trace.json").read_text()))
        result["profile_ranks"] = rank_profile(read_traces(traces))
        if os.environ.get("BENCH_TRACES"):
            keep = Path(os.environ["BENCH_TRACES"]) / name
            shutil.copytree(traces, keep, dirs_exist_ok=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--config", default="./train_configs/deepseek_v3_16b.toml")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps dropped (compile, allocator warm-up)")
    parser.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="record this step with torch.profiler, add rank 0's step summary and kernel-class breakdown",
    )
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    result = train_and_measure(args.name, args.ngpu, args.config, train_args, args.warmup_steps, args.profile_step)
    os.environ["BENCH_COMMAND"] = result.pop("command")
    path = write_result(result, f"e2e_{args.name}")
    if result["returncode"] != 0:
        print(json.dumps({k: result.get(k) for k in ("name", "returncode", "cuda_graphs", "cuda_graph_log")}))
        print(result["error_log_tail"])
        sys.exit(result["returncode"])
    keys = (
        "name",
        "tokens_per_sec_per_gpu",
        "mfu_pct",
        "peak_memory_gib",
        "peak_memory_allocated_gib",
        "recompiles_after_warmup",
        "cuda_graphs",
        "cuda_graph_log",
        "ep_load_imbalance_max",
        "dropped_fraction",
        "memory_budget_gib",  # 0 unless given: the job's own budget is off in a benchmark (module docstring)
        "wall_s",
    )
    print(json.dumps({k: result[k] for k in keys}))
    for step in result.get("profile_breakdown", {}).get("steps", []):
        print("\n".join(markdown_table(step, result["profile_breakdown"])))
    if "profile_ranks" in result:
        print("\nEach rank's profiled step, ms (scripts/bench/rank_profile.py):")
        print("\n".join(rank_table(result["profile_ranks"])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
