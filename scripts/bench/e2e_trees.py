"""Run one e2e job from two source trees on this machine, one after the other, and compare them: the check that a
change is faster (or not slower) and trains the same, with both numbers from one device call.

    python scripts/bench/e2e_trees.py --old /path/to/old/tree --old-commit ada9097 --name 16b8L_ep1 --ngpu 1 \\
        --repeats 2 -- --model.flavor 16B_bench4 --parallelism.expert_parallel_degree 1 --training.steps 18 \\
        --checkpoint.enable=false --metrics.enable_tensorboard=false

Without --old both are this tree, and `--new-args` gives the new runs' extra train args: one setting against its
default in one call (`--new-args=--compile.cuda_graphs`: the step as a CUDA graph against eager).

Runs alternate, old first (old, new, old, new with --repeats 2), each `scripts/bench/e2e.py` in its own tree, named
`<name>_<commit>_r<i>` (`<name>_<commit>_old_r<i>` / `_new_r<i>` in one tree; GIT_COMMIT tells each tree its commit:
a `git archive` copy has no .git). The comparison,
written to `compare_<name>.json` next to the runs' JSONs ($BENCH_OUT or benchmarks/results/): tokens/s of each tree
(median over its runs) and their ratio, peak memory, and the first runs' losses: the largest relative difference at
one step and over windows of --window steps (`loss_curve.window_gaps`). With --repeats 2 or more, also the old tree's
first two runs against each other (the run-to-run noise of the same code) and each repeat's new run against its old.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import REPO_ROOT, RESULTS_DIR, git_commit, median, write_result  # noqa: E402
from scripts.bench.loss_curve import step_gaps, window_gaps  # noqa: E402


def compare(old: list[dict], new: list[dict], window: int) -> dict:
    """Each tree's e2e results (its runs) -> the comparison (module docstring)."""
    trees = {"old": old, "new": new}
    tps = {name: median([r["tokens_per_sec_per_gpu"] for r in runs]) for name, runs in trees.items()}
    comparison = {
        "tokens_per_sec_per_gpu": tps,
        "speedup": tps["new"] / tps["old"],
        "tokens_per_sec_runs": {name: [r["tokens_per_sec_per_gpu"] for r in runs] for name, runs in trees.items()},
        "peak_memory_gib": {name: _max(r["peak_memory_gib"] for r in runs) for name, runs in trees.items()},
        "peak_memory_allocated_gib": {
            name: _max(r["peak_memory_allocated_gib"] for r in runs) for name, runs in trees.items()
        },
        **loss_gaps(old[0]["losses"], new[0]["losses"], window),
    }
    if len(old) > 1:
        # With the router's own routing and atomic-add kernels, one tree's runs differ too: its gap is the noise
        # the new-vs-old gaps are read against.
        comparison["old_run_to_run"] = loss_gaps(old[0]["losses"], old[1]["losses"], window)
        comparison["new_vs_old_by_repeat"] = [
            loss_gaps(o["losses"], n["losses"], window) for o, n in zip(old, new, strict=False)
        ]
    return comparison


def loss_gaps(reference: list[float], losses: list[float], window: int) -> dict:
    """The largest relative loss difference to `reference` at one step and over windows of `window` steps."""
    runs = {"old": reference, "new": losses}
    return {
        "steps_compared": min(len(reference), len(losses)),
        "max_rel_loss_diff": step_gaps(runs, after=0)["new"],
        f"max_rel_loss_diff_{window}_step_windows": window_gaps(runs, window)["new"],
    }


def _max(values) -> float | None:
    """The largest value; None where a run has none (CPU: no device memory)."""
    values = [v for v in values if v is not None]
    return max(values) if values else None


def run_e2e(
    tree: Path, commit: str, run_name: str, out_dir: Path, args: argparse.Namespace, train_args: list[str]
) -> dict:
    """`scripts/bench/e2e.py` in `tree`, its result JSON written to (and read from) `out_dir`."""
    command = [
        sys.executable, "scripts/bench/e2e.py", "--name", run_name, "--ngpu", str(args.ngpu), "--config", args.config,
        "--warmup-steps", str(args.warmup_steps), "--profile-step", str(args.profile_step), "--", *train_args,
    ]  # fmt: skip
    env = {**os.environ, "GIT_COMMIT": commit, "BENCH_OUT": str(out_dir)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    print(done.stdout.splitlines()[0] if done.stdout else done.stderr[-2000:], flush=True)
    return json.loads((out_dir / f"e2e_{run_name}.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="the other source tree (e.g. a `git archive` of it); default: this")
    parser.add_argument("--old-commit", help="the old tree's commit (named in its results); needs --old")
    parser.add_argument("--new-args", default="", help="train args only the new runs get, one string (shlex)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--config", default="./train_configs/deepseek_v3_16b.toml", help="relative to each tree")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tree, alternating")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--profile-step", type=int, default=0)
    parser.add_argument("--window", type=int, default=20, help="steps per window of the loss comparison")
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    if (args.old is None) != (args.old_commit is None):
        parser.error("--old and --old-commit go together (neither: both runs use this tree)")
    new_commit = git_commit()[:12]
    trees = {"old": (args.old.resolve(), args.old_commit) if args.old else (REPO_ROOT, new_commit)}
    trees["new"] = (REPO_ROOT, new_commit)
    one_tree = args.old is None
    run_args = {"old": train_args, "new": [*train_args, *shlex.split(args.new_args)]}
    out_dir = Path(os.environ.get("BENCH_OUT") or RESULTS_DIR).resolve()
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for repeat in range(1, args.repeats + 1):
        for name, (tree, commit) in trees.items():
            run_name = f"{args.name}_{commit}_{name}_r{repeat}" if one_tree else f"{args.name}_{commit}_r{repeat}"
            results[name].append(run_e2e(tree, commit, run_name, out_dir, args, run_args[name]))
    failed = [r["name"] for runs in results.values() for r in runs if r["returncode"] != 0]
    for run in (r for runs in results.values() for r in runs if r["returncode"] != 0):
        print(f"{run['name']} failed; its log ends:\n" + "\n".join(run["error_log_tail"].splitlines()[-25:]))
    comparison = {"failed": failed} if failed else compare(results["old"], results["new"], args.window)
    summary = {
        "name": args.name,
        "commits": {name: commit for name, (_, commit) in trees.items()},
        "runs": {name: [r["name"] for r in runs] for name, runs in results.items()},
        "train_args": train_args,
        "new_args": shlex.split(args.new_args),
        "cuda_graphs": {name: runs[0].get("cuda_graphs") for name, runs in results.items()},
        **comparison,
    }
    write_result(summary, f"compare_{args.name}", out_dir)  # with the command, device, torch and commit
    shown = ("speedup", "tokens_per_sec_per_gpu", "max_rel_loss_diff", "cuda_graphs", "failed")
    print(json.dumps({k: v for k, v in summary.items() if k in shown}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
