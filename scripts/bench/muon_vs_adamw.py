"""AdamW against Muon in the real trainer, same data and the same lr and weight decay (Moonlight's recipe: Muon's
update scaled to AdamW's RMS): step time, memory and the loss curve.

    python scripts/bench/muon_vs_adamw.py --name 16b8L_1gpu --ngpu 1 --steps 30 --repeats 2 -- \\
        --model.flavor 16B_bench4 --parallelism.expert_parallel_degree 1 --checkpoint.enable=false \\
        --metrics.enable_tensorboard=false
    python scripts/bench/muon_vs_adamw.py --name 16b8L_1gpu --ngpu 1 --steps 300 -- <the same flags>

With --match-update-rms, AdamW runs first with `--metrics.log_update_rms` and Muon then with `--muon.update_rms` r:
AdamW's update RMS over Muon's parameter groups (weighted by their sizes), averaged over the steps weighted by their
lr (so that both move the weights as far over the run): Moonlight's recipe with this job's AdamW RMS in place of the
0.2 it measured on its own runs.

Each run is `scripts/bench/e2e.py`'s (run_train.sh with the job's config, steady-state steps after --warmup-steps),
named `e2e_<name>_<adamw|muon>_<steps>steps[_r<i>]`; with --repeats the runs alternate AdamW, Muon, AdamW, ... The
comparison, `compare_<name>_muon_vs_adamw_<steps>steps.json` next to them ($BENCH_OUT or benchmarks/results/): each
optimizer's median tokens/s and step time over its runs, Muon's step time over AdamW's (the goal: at most 1.08),
peak memory, and the first runs' loss gaps (`loss_curve.py`; plot with `loss_curve.py <adamw json> <muon json>`).
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import RESULTS_DIR, median, write_result  # noqa: E402
from scripts.bench.e2e import train_and_measure  # noqa: E402
from scripts.bench.loss_curve import end_gaps, step_gaps, window_gaps  # noqa: E402

OPTIMIZERS = ("AdamW", "Muon")


def compare(runs: dict[str, list[dict]], window: int) -> dict:
    """Each optimizer's e2e results -> the comparison (module docstring)."""
    tps = {name: median([r["tokens_per_sec_per_gpu"] for r in results]) for name, results in runs.items()}
    tokens_per_step = runs["AdamW"][0]["tokens_per_gpu_per_step"]
    step_ms = {name: tokens_per_step / rate * 1e3 for name, rate in tps.items()}
    losses = {name: results[0]["losses"] for name, results in runs.items()}
    last = min(20, len(losses["AdamW"]))  # the end loss: the mean of the last steps (one step's loss is noisy)
    return {
        "tokens_per_sec_per_gpu": tps,
        "tokens_per_sec_runs": {name: [r["tokens_per_sec_per_gpu"] for r in results] for name, results in runs.items()},
        "step_ms": step_ms,
        "muon_step_time_over_adamw": step_ms["Muon"] / step_ms["AdamW"],
        "peak_memory_gib": {  # None on a CPU
            name: max((r["peak_memory_gib"] for r in results if r["peak_memory_gib"] is not None), default=None)
            for name, results in runs.items()
        },
        "end_loss": {name: gap["end_loss"] for name, gap in end_gaps(losses, last).items()},
        "muon_loss_gap_end": end_gaps(losses, last)["Muon"]["relative_gap"],
        f"muon_max_loss_gap_{window}_step_windows": window_gaps(losses, window)["Muon"],
        "muon_max_loss_gap_one_step_after_20": step_gaps(losses, after=20)["Muon"],
    }


def muon_group_sizes(config: str, train_args: list[str]) -> dict[str, int]:
    """{parameter group Muon updates in this job: its number of parameters} (the model built on meta)."""
    import torch

    from torchtitan.components.optimizer import group_parameters
    from torchtitan.config import ConfigManager
    from torchtitan.models.spec import get_model_spec

    job = ConfigManager().parse_args(["--job.config_file", config, *train_args, "--optimizer.name", "Muon"])
    spec = get_model_spec(job.model.name)
    with torch.device("meta"):
        model = spec.build(spec.model_args(job))
    sizes = dict.fromkeys(job.muon.groups, 0)
    for param, group in group_parameters(model).items():
        if group in sizes:
            sizes[group] += param.numel()
    return sizes


def adamw_update_rms(result: dict, sizes: dict[str, int]) -> float:
    """AdamW's update RMS over the groups of `sizes`, each logged step weighted by its lr (module docstring)."""
    rms, lrs = result["update_rms"], result["update_rms_lr"]
    total = sum(sizes.values())
    per_step = [
        (sum(sizes[group] * rms[group][i] ** 2 for group in sizes if sizes[group]) / total) ** 0.5
        for i in range(len(lrs))
    ]
    return sum(lr * value for lr, value in zip(lrs, per_step, strict=True)) / sum(lrs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="training.steps of every run")
    parser.add_argument("--config", default="./train_configs/deepseek_v3_16b.toml")
    parser.add_argument("--repeats", type=int, default=1, help="runs per optimizer, alternating")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--window", type=int, default=20, help="steps per window of the loss comparison")
    parser.add_argument(
        "--match-update-rms", action="store_true", help="Muon's update RMS set to AdamW's measured one (docstring)"
    )
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    out_dir = Path(os.environ.get("BENCH_OUT") or RESULTS_DIR)
    runs: dict[str, list[dict]] = {name: [] for name in OPTIMIZERS}
    matched: dict = {}
    for repeat in range(1, args.repeats + 1):
        for name in OPTIMIZERS:
            run_name = f"{args.name}_{name.lower()}_{args.steps}steps" + (f"_r{repeat}" if args.repeats > 1 else "")
            optimizer_args = ["--optimizer.name", name, "--training.steps", str(args.steps)]
            if args.match_update_rms and name == "AdamW":
                optimizer_args += ["--metrics.log_update_rms"]
            if args.match_update_rms and name == "Muon":
                if not matched:  # from the first AdamW run
                    adamw = runs["AdamW"][0]
                    if adamw["returncode"] != 0:
                        break
                    sizes = muon_group_sizes(args.config, train_args)
                    matched = {"muon_update_rms": adamw_update_rms(adamw, sizes), "group_sizes": sizes}
                    print(json.dumps(matched))
                optimizer_args += ["--muon.update_rms", f"{matched['muon_update_rms']:.4f}"]
            result = train_and_measure(
                run_name, args.ngpu, args.config, [*train_args, *optimizer_args], args.warmup_steps
            )
            write_result(result, f"e2e_{run_name}", out_dir)
            print(json.dumps({k: result.get(k) for k in ("name", "tokens_per_sec_per_gpu", "peak_memory_gib")}))
            runs[name].append(result)
    failed = [r["name"] for results in runs.values() for r in results if r["returncode"] != 0]
    for result in (r for results in runs.values() for r in results if r["returncode"] != 0):
        print(result["error_log_tail"])
    summary = {"name": args.name, "steps": args.steps, "train_args": train_args, **matched}
    failed += [] if len(runs["Muon"]) == args.repeats else ["Muon (not run: the AdamW run failed)"]
    summary |= {"failed": failed} if failed else compare(runs, args.window)
    path = write_result(summary, f"compare_{args.name}_muon_vs_adamw_{args.steps}steps", out_dir)
    print(json.dumps({k: v for k, v in summary.items() if k in ("step_ms", "muon_step_time_over_adamw", "failed")}))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
