"""Regenerate benchmarks/README.md (tables) and benchmarks/e2e_tokens_per_sec.png from benchmarks/results/*.json.

python scripts/bench/report.py        # needs matplotlib for the plot
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import RESULTS_DIR  # noqa: E402
from scripts.bench.gpu_acceptance import row_cells  # noqa: E402
from scripts.bench.trace_breakdown import markdown_table  # noqa: E402

BENCH_DIR = RESULTS_DIR.parent


def load(prefix: str) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob(f"{prefix}*.json"))]
    return [r for r in results if r.get("returncode", 0) == 0]


def routing(result: dict) -> str:
    """'natural' (the router's own) or 'balanced' (forced round-robin); results before the field was added were all
    forced-balanced (`balanced_routing` in e2e results, nothing in layer results)."""
    if "routing" in result:
        return result["routing"]
    return "balanced" if result.get("balanced_routing", True) else "natural"


def e2e_table(results: list[dict]) -> list[str]:
    rows = [
        "| run | flavor | GPUs (FSDP x EP) | backend | compile | AC | routing | tokens/GPU/step | tokens/s/GPU "
        "| TFLOPS/GPU | MFU | peak mem (GiB) | recompiles after warm-up | last loss | device | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        par = r["parallel"]
        rows.append(
            f"| {r['name']} | {r['model_flavor']} | {r['ngpu']} ({par['dp_shard']} x {par['ep']}) | "
            f"{r['ep_backend']} | "
            f"{'yes' if r['compile'] else 'no'} | {r['activation_checkpoint']} | {routing(r)} | "
            f"{r['tokens_per_gpu_per_step']:,} | "
            f"{r['tokens_per_sec_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | {r['mfu_pct']:.1f}% | "
            f"{r['peak_memory_gib']:.1f} | {r.get('recompiles_after_warmup', 'n/a')} | {r['last_loss']:.3f} | "
            f"{r['device_name']} | {r['git_commit'][:8]} |"
        )
    return rows


def breakdown_tables(results: list[dict]) -> list[str]:
    """The recorded step of each profiled e2e run (`profile_breakdown`) by kernel class, oldest first."""
    lines = [
        "The kernels launched inside the recorded step (`e2e.py --profile-step N`; for a trace an older tree",
        "wrote, `trace_breakdown.py <trace> --add-to <its e2e result>`), by class (`KERNEL_CLASSES` in",
        "`scripts/bench/trace_breakdown.py`): ms per step, % of the step's device span (first kernel start to last",
        "kernel end), achieved TFLOP/s (GEMMs, attention) or GB/s (memory-bound classes) against the device's dense",
        "bf16 peak or HBM bandwidth, and idle (no kernel on any stream). Kernels still queued from the step before are",
        "left out; `-` where the trace does not tell (how FLOPs and bytes are found: the script's docstring). Reading",
        "it: a class would take ms x % of bound / 100 at its bound, the rest is what it loses; where streams overlap",
        "the classes and idle add up to more than the span (last row).",
        "",
    ]
    profiled = sorted((r for r in results if "profile_breakdown" in r), key=lambda r: r["date"])
    if not profiled:
        lines += ["Before / after (issue 36): **to be filled from the GPU run.**", ""]
    for r in profiled:
        for step in r["profile_breakdown"]["steps"]:
            table = markdown_table(step, r["profile_breakdown"])
            lines += [f"`{r['name']}`, commit {r['git_commit'][:8]}, {r['date'][:10]}: {table[0]}", *table[1:], ""]
    return lines


def acceptance_tables(results: list[dict]) -> list[str]:
    """One table per `gpu_acceptance.py` invocation, newest first."""
    lines = []
    for r in sorted(results, key=lambda r: r["date"], reverse=True):
        done = "all rows" if r["complete"] else "cut off before its last rows"
        lines += [
            f"`{r['command']}` on {r['ngpu']} x {r['device_name']}, torch {r['torch_version']}, DeepEP "
            f"{r['deep_ep']}, commit {r['git_commit'][:8]}, {r['date'][:10]}, flavor {r['flavor']}, EP={r['ep']}, "
            f"{r['steps']} steps ({done}):",
            "",
            "| row | status | max rel loss diff | bound | tokens/s/GPU | MFU | reserved / allocated (GiB) "
            "| recompiles | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in r["rows"]:
            cell = row_cells(row)
            memory = "-" if row.get("peak_memory_gib") is None else f"{cell['peak_memory_gib']} / "
            memory += cell["peak_memory_allocated_gib"] if memory != "-" else ""
            note = row.get("reason") or row["why"]
            if row["name"] == "hf_export_import" and row["status"] == "passed":
                note = (f"round trip exact; export logits rel diff {row['logits_rel_diff_export']:.1e}, "
                        f"top-1 agreement {row['top1_agreement_export']:.3f}")  # fmt: skip
            lines.append(
                f"| {row['name']} | {row['status']} | {cell['max_rel_loss_diff']} | {row['tolerance']:g} | "
                f"{cell['tokens_per_sec_per_gpu']} | {cell['mfu_pct']} | {memory} | "
                f"{cell['recompiles_after_warmup']} | {note} |"
            )
        lines.append("")
    return lines


def moe_table(results: list[dict]) -> list[str]:
    rows = [
        "| layer | backend | mode | variant | routing (max/mean expert load) | EP | tokens/rank | fwd (ms) "
        "| fwd+bwd (ms) | matmul bound (ms) | x bound | peak mem (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    results = sorted(
        results,
        key=lambda r: (r["layer"], r["ep"], r["tokens_per_rank"], r["backend"], r["mode"], routing(r), variant(r)),
    )
    for r in results:
        load = f" ({r['max_over_mean_expert_load']:.1f})" if "max_over_mean_expert_load" in r else ""
        rows.append(
            f"| {r['layer']} | {r['backend']} | {r['mode']} | {variant(r)} | {routing(r)}{load} | {r['ep']} | "
            f"{r['tokens_per_rank']} | {r['fwd_ms']:.2f} | "
            f"{r['fwd_bwd_ms']:.2f} | {r['bound_fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms'] / r['bound_fwd_bwd_ms']:.2f} | "
            f"{r['peak_memory_gib']:.1f} |"
        )
    return rows


def variant(result: dict) -> str:
    """The moe_layer options that change what runs: FP8 experts, FP8 dispatch; and, in results recorded before
    they were removed, the EP overlap and the comm slowdown."""
    slowdown = result.get("comm_slowdown", 1)
    options = (
        ("overlap", result.get("overlap")),
        ("fp8 experts", result.get("float8_experts")),
        ("fp8 dispatch", result.get("float8_dispatch")),
        (f"comm x{slowdown}", slowdown > 1),
    )
    tags = [tag for tag, on in options if on]
    return ", ".join(tags) or "-"


GROUPED_GEMM_VARIANTS = (
    "bare_grouped_mm", "experts_eager", "experts_compiled", "experts_fp8_eager", "experts_fp8_compiled"
)  # fmt: skip


def grouped_gemm_table(results: list[dict]) -> list[str]:
    rows = [
        "| layer | EP | rows (tokens x top_k) | local experts | variant | fwd (ms) | fwd+bwd (ms) | fwd+bwd TFLOP/s "
        "| commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for name in GROUPED_GEMM_VARIANTS:
            if name not in r:  # FP8 variants exist from 6039edc on
                continue
            v = r[name]
            rows.append(
                f"| {r['layer']} | {r['ep']} | {r['rows']} | {r['local_experts']} | {name} | {v['fwd_ms']:.2f} | "
                f"{v['fwd_bwd_ms']:.2f} | {v['fwd_bwd_tflops']:.0f} | {r['git_commit'][:7]} |"
            )
    return rows


def bandwidth_table(results: list[dict]) -> list[str]:
    rows = [
        "| EP | tokens | hidden | dispatch GB/s | combine GB/s | formula |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r['ep']} | {r['num_tokens']} | {r['hidden']} | {r['dispatch_gbps']:.1f} | {r['combine_gbps']:.1f} | "
            f"{r['formula']} |"
        )
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    values = [r["tokens_per_sec_per_gpu"] for r in results]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.5))
    ax.barh(names, values, color="tab:blue")
    ax.set_xlabel("tokens / s / GPU (median of steady-state steps)")
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    e2e, moe, bw = load("e2e_"), load("moe_layer_"), load("deepep_bandwidth_")
    acceptance = load("acceptance_")
    gemm = load("grouped_gemm_")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python scripts/bench/report.py` from `benchmarks/results/*.json`; each JSON holds the exact",
        "command, device, torch version and git commit. MFU uses the bf16 dense peak of the device (H200/H100: 989",
        "TFLOP/s). Matmul bounds use the measured 790 TFLOP/s bf16 rate of our H200s.",
        "",
        "## GPU acceptance (`scripts/bench/gpu_acceptance.py`)",
        "",
        "Every feature trained against a base run of the same invocation; the bounds and why are in the script's",
        "docstring. Rows that need more GPUs than the machine had are skipped.",
        "",
        *acceptance_tables(acceptance),
        "## End to end",
        "",
        *e2e_table(e2e),
        "",
        "![tokens/s per GPU](e2e_tokens_per_sec.png)",
        "",
        "### Where a step's device time goes",
        "",
        *breakdown_tables(e2e),
        "## MoE layer (forward + backward)",
        "",
        *moe_table(moe),
        "",
    ]
    if gemm:
        lines += [
            "## Routed experts alone: grouped GEMM SwiGLU on one GPU (one EP rank's share)",
            "",
            *grouped_gemm_table(gemm),
            "",
        ]
    if bw:
        lines += ["## DeepEP dispatch/combine bandwidth", "", *bandwidth_table(bw), ""]
    notes = BENCH_DIR / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text()]
    (BENCH_DIR / "README.md").write_text("\n".join(lines) + "\n")
    if e2e:
        plot(e2e, BENCH_DIR / "e2e_tokens_per_sec.png")


if __name__ == "__main__":
    main()
