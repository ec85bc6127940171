"""The plan (`python -m torchtitan.plan`) against every kind of run measured on GPUs: benchmarks/plan_check.json.

    python scripts/plan_check.py           # rewrite benchmarks/plan_check.json
    python scripts/plan_check.py --check   # exit 1 if the file differs from what the code predicts now

Each row is the newest JSON of its kind under benchmarks/results, planned from the job that JSON recorded (its
command's config file, its train_args, its world size, its GPU) with the defaults of its commit where they have
changed since (`then`). Memory is the peak reserved GiB per GPU, what the trainer logs as `memory`; tokens/s the
median of the run's steady steps. `tests/unit/plan/test_plan_check.py` regenerates the file and holds every row to
MEMORY_BOUND and SPEED_BOUND.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan.config.manager import renamed_flag  # noqa: E402
from torchtitan.plan.__main__ import CHECK_FILE, plan_from_argv  # noqa: E402
from torchtitan.plan.memory import GIB  # noqa: E402

RESULTS = CHECK_FILE.parent / "results"
JOB = "train_configs/deepseek_v3_16b.toml"  # the CONFIG_FILE of e2e runs that do not record theirs (`config_file`)
SMS_24 = ("--deepep.num_sms", "24")  # the default before e1516f0 (48) and 8f39102 (64)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    then: tuple[str, ...] = ()
    """Flags for the defaults of the run's commit that differ from today's."""


RUNS = [
    Run("16B_bench4, 1 x H100, fp32 moments", "e2e_16b8L_ep1_compile_sac_d128255.json"),
    Run("16B_bench4, 1 x H200, fp32 moments", "e2e_16b8L_ep1_compile_sac_09a0823.json"),
    Run("16B_bench4, 1 x H100, bf16 moments", "e2e_16b8L_ep1_300steps_moments_bfloat16_sr_r3_2251419.json"),
    Run("16B_bench4, 1 x H200, Muon, 4 x 4096 tokens a step", "e2e_16b8L_1gpu_muon_300steps_86b94cf.json"),
    Run("16B_bench4, 1 x H200, AdamW, 128 x 4096 tokens a step", "e2e_16b8L_1gpu_gbs128_adamw_8steps_4b367e9.json"),
    Run("16B_bench4, 1 x H200, Muon, 128 x 4096 tokens a step", "e2e_16b8L_1gpu_gbs128_muon_8steps_4b367e9.json"),
    Run("16B_bench4, FSDP2 x EP2 deepep, 2 x H100", "e2e_16b8L_ep2_24steps_deepep64_58c3359.json"),
    Run("16B_bench4, FSDP2 x EP2 deepep, 2 x H200", "e2e_16b8L_ep2_24steps_deepep64_8f39102.json"),
    Run("16B_bench4, FSDP4 x EP4 deepep, 4 x H100", "e2e_16b8L_ep4_deepep_sms48_d128255.json"),
    Run("16B (27 layers), FSDP4 x EP4, budget 72, 4 x H100", "e2e_16b_ep4_budget72_2251419.json", SMS_24),
    Run(
        "16B (27 layers), FSDP4 x EP4, budget 72, bf16 moments, 4 x H100",
        "e2e_16b_ep4_budget72_bf16moments_b4a7045.json",
        SMS_24,
    ),  # fmt: skip
    Run("Qwen3-30B-A3B, 8 layers, 1 x H100, bf16 moments", "e2e_qwen3_30b8L_ep1_compile_sac_7089c0f.json"),
    Run(
        "16B_accept, CP=2 at 65,536 tokens, 2 ranks on one H200 (memory only)",
        "cp_memory_83badba.json",
        ("--activation_checkpoint.memory_budget_gib", "0"),
    ),  # the job file had no budget then
]
MISSING = [
    "16B (27 layers), FSDP2 x EP2, bf16 moments, budget 125, 2 x H200: measured at c8ca621 (22.7k tokens/s, 116.0 "
    "GiB, as the issue tracker records) but no JSON was committed: python -m torchtitan.plan --job.config_file "
    "train_configs/deepseek_v3_16b.toml --gpus-per-node 2 --gpu h200 --model.flavor 16B "
    "--parallelism.expert_parallel_degree 2 --optimizer.moments_dtype bfloat16 "
    "--activation_checkpoint.memory_budget_gib 125",
]


def job_of(result: dict) -> tuple[list[str], int, str]:
    """(the job's flags, world size, GPU kind) a result JSON recorded, renamed keys by their names today."""
    gpu = "h200" if "H200" in result["device_name"] else "h100"
    # the job file's defaults have changed since (bf16 moments, an auto budget): what a run's JSON records it used,
    # else the defaults of its time (fp32 moments, no budget); its own flags come after and win
    moments = ("--optimizer.moments_dtype", result.get("moments_dtype") or "float32")
    budget = ("--activation_checkpoint.memory_budget_gib", str(result.get("memory_budget_gib") or 0))
    if "runs" in result:  # cp_memory.py: one job, the CP=2 run's own flags on top
        flags, world = [*moments, *budget, *result["job"], *result["runs"]["cp2"]["args"]], 2
    else:
        job = result.get("config_file", JOB)
        flags, world = ["--job.config_file", job, *moments, *budget, *result["train_args"]], result["ngpu"]
    return list(map(renamed_flag, flags)), world, gpu


def measured(result: dict) -> tuple[float, float | None]:
    """(peak reserved GiB per GPU, tokens/s/GPU or None)."""
    if "runs" in result:  # two ranks sharing one GPU: memory is real, speed is not
        return max(rank["max_reserved_gib"] for rank in result["runs"]["cp2"]["per_rank_peak"]), None
    return result["peak_memory_gib"], result["tokens_per_sec_per_gpu"]


def rows() -> list[dict]:
    logging.disable(logging.WARNING)
    out = []
    for run in RUNS:
        result = json.loads((RESULTS / run.source).read_text())
        flags, world, gpu = job_of(result)
        plan = plan_from_argv([*flags, *run.then], nnodes=1, gpus_per_node=world, gpu=gpu)
        memory, speed = measured(result)
        out.append(
            {
                "run": run.name,
                "source": f"benchmarks/results/{run.source}",
                "memory_gib_predicted": round(plan.peak.reserved / GIB, 2),
                "memory_gib_measured": round(memory, 2),
                "tokens_per_sec_predicted": round(plan.tokens_per_sec_per_gpu),
                "tokens_per_sec_measured": round(speed) if speed is not None else None,
            }
        )
    return out


def report() -> dict:
    return {
        "memory": "peak reserved GiB per GPU (the trainer's logged `memory`), busiest pipeline rank",
        "tokens_per_sec": "tokens/s/GPU as the trainer logs `tps`: the run's median over its steady steps",
        "rows": rows(),
        "missing": MISSING,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    text = json.dumps(report(), indent=1) + "\n"
    if args.check:
        if CHECK_FILE.read_text() != text:
            print(
                f"{CHECK_FILE} differs from the plan's predictions: run python scripts/plan_check.py", file=sys.stderr
            )
            return 1
        return 0
    CHECK_FILE.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
