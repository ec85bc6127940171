"""Train the same EP=2 job from two source trees, both ranks of each on GPU 0 (`shared_gpu.py`), and compare losses
and per-rank memory step by step: the check that a refactor changed no numbers.

    nvidia-cuda-mps-control -d
    python scripts/bench/shared_gpu_trees.py --old /path/to/old/tree --rows fp8_experts,fp8_dispatch \
        --out benchmarks/results/shared_gpu_trees_<commit>.json

Each row runs the old and the new tree (this checkout) at the same time, each as `torchrun --nproc-per-node 2
scripts/bench/shared_gpu.py` from its own tree (deep_ep must be importable). Speed is meaningless this way (two jobs,
four ranks, one GPU, gloo): only losses and the allocator's per-rank numbers are compared. The rows' flags are
today's names: an old tree from before a key's rename (`config/manager.py`'s RENAMED_KEYS) refuses them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import REPO_ROOT, environment  # noqa: E402

JOB = [
    "--job.config_file", "train_configs/deepseek_v3_16b.toml", "--model.flavor", "16B_accept",
    "--parallelism.expert_parallel_degree", "2", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
    "--metrics.log_freq", "1", "--activation_checkpoint.memory_budget_gib", "0",
]  # fmt: skip
ROWS = {
    "base": [],
    "fp8_experts": ["--quantize.float8_experts"],
    "fp8_dispatch": ["--quantize.float8_experts", "--deepep.float8_dispatch"],
}


def launch(tree: Path, args: list[str], dump: Path, port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
        "scripts/bench/shared_gpu.py", *JOB, *args, "--job.dump_folder", str(dump),
    ]  # fmt: skip
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    log = open(dump.with_suffix(".log"), "w")
    return subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def records(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def compare(old: list[dict], new: list[dict]) -> dict:
    steps = [(a, b) for a, b in zip(old, new, strict=False) if a["step"] == b["step"]]
    rel = [abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in steps]
    return {
        "steps_compared": len(steps),
        "max_rel_loss_diff": max(rel) if rel else None,
        "peak_reserved_gib": [max(r["memory_gib"] for r in run) for run in (old, new)],
        "peak_allocated_gib": [max(r["memory_allocated_gib"] for r in run) for run in (old, new)],
        "losses_old": [a["loss"] for a, _ in steps],
        "losses_new": [b["loss"] for _, b in steps],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the other source tree (e.g. a `git archive` of it)")
    parser.add_argument("--rows", default="fp8_experts,fp8_dispatch", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trees_"))
    result = {**environment(), "old_tree": str(args.old), "steps": args.steps, "job": JOB, "rows": {}}
    for row in args.rows.split(","):
        row_args = [*ROWS[row], "--training.steps", str(args.steps)]
        dumps = {name: work / f"{row}_{name}" for name in ("old", "new")}
        jobs = [
            launch(tree, row_args, dumps[name], 29500 + 10 * i)
            for i, (name, tree) in enumerate((("old", args.old.resolve()), ("new", REPO_ROOT)))
        ]
        codes = [job.wait() for job in jobs]
        old, new = records(dumps["old"]), records(dumps["new"])
        result["rows"][row] = {"args": ROWS[row], "exit_codes": codes, **(compare(old, new) if old and new else {})}
        for name, dump in dumps.items():
            if codes[0 if name == "old" else 1]:
                print(dump.with_suffix(".log").read_text()[-3000:])
        print(row, json.dumps({k: v for k, v in result["rows"][row].items() if not k.startswith("losses")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if all(not any(r["exit_codes"]) for r in result["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
