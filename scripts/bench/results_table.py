"""Generate benchmarks/RESULTS.md, the current figure of every benchmark row, from the result JSONs it cites.

    python scripts/bench/results_table.py            # rewrite benchmarks/RESULTS.md
    python scripts/bench/results_table.py --plots    # and benchmarks/plots/*.png (needs matplotlib)
    python scripts/bench/results_table.py --check    # exit 1 if RESULTS.md is not what the JSONs give

Each row below names its JSON in benchmarks/results/ (and, for a ratio, a run of the same device call: machines of
one kind differ by up to 10% between calls, so ratios are only taken within one call). After a new run, point the
row at the new JSON and regenerate; tests/unit/scripts/test_results_table.py fails while RESULTS.md is stale. The
GPU acceptance matrix needs no editing: it takes the newest run of each row at each GPU count from every
acceptance_*.json at the top level of benchmarks/results/ (benchmarks/results/archive/ is never read).
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
from torchtitan.config.manager import renamed_flag  # noqa: E402

BENCH_DIR = REPO_ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
PLOTS_DIR = BENCH_DIR / "plots"
GPU_COUNTS = (1, 2, 4)


@dataclass(frozen=True)
class Run:
    """One end-to-end run (`scripts/bench/e2e.py` JSON); `against` is a run of the same device call to divide by,
    `upstream` upstream torchtitan's run of the same job in the same call."""

    label: str
    file: str
    against: str | None = None
    against_label: str = ""
    upstream: str | None = None


@dataclass(frozen=True)
class LossCheck:
    """Loss curves of `runs` (their mean) against those of `reference` (their mean), over the steps both have."""

    label: str
    reference: tuple[str, ...]
    runs: tuple[str, ...]


# 16B_bench4: the DeepSeek-V3 16B layer shapes, 8 layers (4.6B parameters); compile + per-op SAC, the router's own
# routing, 4 x 4096 tokens per GPU, median tokens/s of the steady steps.
BENCH4 = (
    Run("1 GPU", "e2e_16b8L_ep1_compile_sac_09a0823.json"),
    Run("1 GPU", "e2e_16b8L_ep1_compile_sac_d128255.json"),
    Run("1 GPU (H100), token shards + document ids from the index", "e2e_16b8L_ep1_data_0dacb28_r1.json",
        "e2e_16b8L_ep1_data_f9d5aa5_r1.json", "f9d5aa5, the in-memory token stream (same machine)"),
    Run("1 GPU, FP8 experts", "e2e_16b8L_ep1_fp8experts_d172a53.json", "e2e_16b8L_ep1_bf16_d172a53.json", "bf16"),
    Run("1 GPU, FP8 experts + linears", "e2e_16b8L_ep1_fp8all_d172a53.json", "e2e_16b8L_ep1_bf16_d172a53.json",
        "bf16"),
    Run("1 GPU, CUDA graphs (bf16 moments)", "e2e_16b8L_ep1_cuda_graphs_b7830bc_new_r1.json",
        "e2e_16b8L_ep1_cuda_graphs_b7830bc_old_r1.json", "graphs off"),
    Run("1 GPU, Muon (300 steps)", "e2e_16b8L_1gpu_muon_300steps_86b94cf.json"),
    Run("1 GPU, Muon, global batch 16 (4 micro-batches, 300 steps)", "e2e_16b8L_1gpu_gbs16_muon_300steps_498a64b.json",
        "e2e_16b8L_1gpu_gbs16_adamw_300steps_498a64b.json", "AdamW (the next run, same machine)"),
    Run("1 GPU, Muon, global batch 128 (32 micro-batches)", "e2e_16b8L_1gpu_gbs128_muon_8steps_4b367e9.json",
        "e2e_16b8L_1gpu_gbs128_adamw_8steps_4b367e9.json", "AdamW"),
    Run("1 GPU, bf16 Adam moments (300 steps)", "e2e_16b8L_ep1_300steps_moments_bfloat16_sr_r2_2251419.json",
        "e2e_16b8L_ep1_300steps_moments_float32_r3_2251419.json", "fp32 moments"),
    Run("FSDP2 x EP2, deepep", "e2e_16b8L_ep2_24steps_deepep64_8f39102.json",
        "e2e_16b8L_ep2_24steps_standard_8f39102.json", "standard all-to-all"),
    Run("FSDP2 x EP2, deepep", "e2e_16b8L_ep2_24steps_deepep64_58c3359.json",
        "e2e_16b8L_ep2_24steps_standard_58c3359.json", "standard all-to-all"),
    Run("FSDP2 x EP2, deepep (48 SMs)", "e2e_16b8L_ep2_deepep_sms48_d128255.json",
        "e2e_16b8L_ep1_compile_sac_d128255.json", "1 GPU"),
    Run("FSDP2 x EP2, deepep (24 SMs), no activation checkpointing", "e2e_16b8L_ep2_deepep_ac_none_635ac47.json",
        "e2e_16b8L_ep1_compile_sac_635ac47.json", "1 GPU"),
    Run("FSDP2 x EP2, deepep (24 SMs), full AC", "e2e_16b8L_ep2_fullac_12b4e7d.json",
        "e2e_16b8L_ep2_deepep_sac_12b4e7d.json", "per-op SAC"),
    Run("FSDP2 x EP2, FP8 experts + FP8 dispatch (48 SMs)", "e2e_16b8L_ep2_24steps_fp8_48_58c3359.json",
        "e2e_16b8L_ep2_24steps_deepep48_58c3359.json", "bf16"),
    Run("FSDP2 x EP2, sync-free dispatch, capacity 1.2 (24 SMs)", "e2e_16b8L_ep2_deepep_syncfree_cap1.2_9113df4.json",
        "e2e_16b8L_ep2_deepep_sac_9113df4.json", "synced dispatch"),
    Run("FSDP4 x EP4, deepep (48 SMs)", "e2e_16b8L_ep4_deepep_sms48_d128255.json",
        "e2e_16b8L_ep1_compile_sac_d128255.json", "1 GPU"),
    Run("FSDP4 x EP4, deepep (24 SMs)", "e2e_16b8L_ep4_deepep_sac_2251419.json",
        "e2e_16b8L_ep4_standard_2251419.json", "standard all-to-all"),
    Run("FSDP4 x EP4, sync-free dispatch, capacity 1.2 (24 SMs)", "e2e_16b8L_ep4_syncfree_cap1.2_2251419.json",
        "e2e_16b8L_ep4_deepep_sac_2251419.json", "synced dispatch"),
)  # fmt: skip

# The whole 16B (27 layers, 15.7B parameters), the job's settings (train_configs/deepseek_v3_16b.toml).
WHOLE_16B = (
    Run("27 layers, FSDP4 x EP4, memory budget 72 GiB", "e2e_16b_ep4_budget72_2251419.json"),
    Run("27 layers, FSDP4 x EP4, memory budget 72 GiB, bf16 Adam moments",
        "e2e_16b_ep4_budget72_bf16moments_b4a7045.json", "e2e_16b_ep4_budget72_50steps_b4a7045.json", "fp32 moments"),
    Run("27 layers, FSDP4 x EP4, memory budget 64 GiB", "e2e_16b_ep4_budget64_2251419.json"),
)  # fmt: skip

# Other models through the same MoE, exchange and parallelize (the second family's proxy: 8 of Qwen3-30B-A3B's 48
# layers, every width, from scratch), compile + per-op SAC, the router's own routing, 4 x 4096 tokens per GPU.
OTHER_MODELS = (
    Run("Qwen3-30B-A3B, 8 layers (5.6B parameters), 1 GPU, bf16 moments",
        "e2e_qwen3_30b8L_ep1_compile_sac_7089c0f.json"),
)  # fmt: skip

# AdamW's 300 steps at 4 x 4096 tokens, its update RMS logged (end loss 3.6921 against 3.6924 in a run without)
MUON_REFERENCE = "e2e_16b8L_1gpu_matched_rms_adamw_300steps_435dded.json"
LOSSES = (
    LossCheck("1 GPU, 300 steps: bf16 Adam moments against fp32 (two runs each)",
              ("e2e_16b8L_ep1_300steps_moments_float32_r3_2251419.json",
               "e2e_16b8L_ep1_300steps_moments_float32_r4_2251419.json"),
              ("e2e_16b8L_ep1_300steps_moments_bfloat16_sr_r2_2251419.json",
               "e2e_16b8L_ep1_300steps_moments_bfloat16_sr_r3_2251419.json")),
    LossCheck("1 GPU, 300 steps: Muon (Moonlight's update RMS 0.2, AdamW's lr) against AdamW (bf16 moments)",
              (MUON_REFERENCE,), ("e2e_16b8L_1gpu_muon_300steps_86b94cf.json",)),
    LossCheck("1 GPU, 300 steps: Muon at AdamW's measured update RMS (0.22) against that AdamW run (same machine)",
              (MUON_REFERENCE,), ("e2e_16b8L_1gpu_matched_rms_muon_300steps_435dded.json",)),
    LossCheck("1 GPU, 300 steps: Muon at 2x AdamW's lr (4.4e-4) against AdamW",
              (MUON_REFERENCE,), ("e2e_16b8L_1gpu_muon_lr4.4e-4_300steps_4b367e9.json",)),
    LossCheck("1 GPU, 300 steps: Muon at 4x AdamW's lr (8.8e-4) against AdamW",
              (MUON_REFERENCE,), ("e2e_16b8L_1gpu_muon_lr8.8e-4_300steps_4b367e9.json",)),
    LossCheck("1 GPU, 300 steps of global batch 16: Muon (update RMS 0.2) against AdamW",
              ("e2e_16b8L_1gpu_gbs16_adamw_300steps_498a64b.json",),
              ("e2e_16b8L_1gpu_gbs16_muon_300steps_498a64b.json",)),
    LossCheck("1 GPU, 300 steps: FP8 experts + linears against bf16",
              ("e2e_16b8L_ep1_300steps_eb0285c_r1.json",), ("e2e_16b8L_ep1_300steps_fp8all_eb0285c.json",)),
    LossCheck("FSDP2 x EP2, 50 steps: d128255 against 88e71a6 (three runs each)",
              tuple(f"e2e_16b8L_ep2_deepep_50steps_r{i}_88e71a6.json" for i in (1, 2, 3)),
              tuple(f"e2e_16b8L_ep2_deepep_50steps_r{i}_d128255.json" for i in (1, 2, 3))),
)  # fmt: skip
LOSS_WINDOW = 20

CP_MEMORY = "cp_memory_83badba.json"
MEMORY_BREAKDOWN = "memory_breakdown_ep1_7bd600b.json"
GROUPED_GEMM = ("grouped_gemm_16b_ep1_t16384.json", "grouped_gemm_671b_ep4_t8192.json")
OPTIMIZER = "optimizer_16b8L_fsdp1_ep1_a9547a3.json"
OUTPUT_HEAD = "output_head_16384x2048x102400_ebd51e2.json"
DEEPEP_BANDWIDTH = "deepep_bandwidth_ep2_16b_sms64.json"
DATA_LOADER = "data_loader_acc830b.json"


def load(name: str) -> dict:
    return json.loads((RESULTS_DIR / name).read_text())


def cited_files() -> list[str]:
    """Every JSON a table row names (the acceptance matrix's files come from `acceptance_files`)."""
    names = [
        name for run in (*BENCH4, *WHOLE_16B, *OTHER_MODELS) for name in (run.file, run.against, run.upstream) if name
    ]
    names += [name for check in LOSSES for name in (*check.reference, *check.runs)]
    names += [CP_MEMORY, MEMORY_BREAKDOWN, *GROUPED_GEMM, OPTIMIZER, OUTPUT_HEAD, DEEPEP_BANDWIDTH, DATA_LOADER]
    return sorted(set(names))


def device(result: dict) -> str:
    name = result.get("device_name") or result.get("device", "?")
    return name.replace("NVIDIA ", "").replace(" 80GB HBM3", "").split(" (")[0]


def link(name: str) -> str:
    return f"[{Path(name).stem}](results/{name})"


def shown_command(result: dict) -> str:
    """The result's command as a user reruns it (the JSON keeps it as run): the interpreter that ran it as `python`,
    renamed flags by their names today (`config/manager.py`'s RENAMED_KEYS)."""
    words = result["command"].split(" ")
    if words[0].endswith("/python"):
        words[0] = "python"
    return " ".join(map(renamed_flag, words))


def commit(result: dict) -> str:
    return str(result.get("git_commit", "?"))[:7]


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def runs_table(runs: tuple[Run, ...]) -> list[str]:
    with_upstream = any(run.upstream for run in runs)
    header = "| configuration | GPUs | tokens/s/GPU | MFU | reserved / allocated GiB | against a run, same machine |"
    header += " upstream torchtitan, same machine |" if with_upstream else ""
    lines = [f"{header} commit | result |", "| --- " * (header.count("|") + 1) + "|"]
    commands = []
    for run in runs:
        r = load(run.file)
        cells = [
            run.label,
            f"{r['ngpu']} x {device(r)}",
            f"{r['tokens_per_sec_per_gpu'] / 1e3:.1f}k",
            f"{r['mfu_pct']:.1f}%",
            f"{gib(r['peak_memory_gib'])} / {gib(r.get('peak_memory_allocated_gib'))}",
            ratio(r, run.against, run.against_label),
        ]
        if with_upstream:
            cells.append(ratio(r, run.upstream, "upstream"))
        cells += [commit(r), link(run.file)]
        lines.append("| " + " | ".join(cells) + " |")
        commands += [f"- {link(name)} ({load(name)['date'][:10]}): `{shown_command(load(name))}`"
                     for name in (run.file, run.upstream) if name]  # fmt: skip
    return [*lines, "", "<details><summary>Commands</summary>", "", *commands, "", "</details>", ""]


def ratio(result: dict, other_file: str | None, other_label: str) -> str:
    """`result`'s tokens/s over the other run's, with the other's tokens/s; "-" without another run."""
    if not other_file:
        return "-"
    other = load(other_file)["tokens_per_sec_per_gpu"]
    return f"{result['tokens_per_sec_per_gpu'] / other:.3f}x {other_label} ({other / 1e3:.1f}k)"


def mean_curve(names: tuple[str, ...]) -> list[float]:
    curves = [load(name)["losses"] for name in names]
    steps = min(len(curve) for curve in curves)
    return [sum(curve[i] for curve in curves) / len(curves) for i in range(steps)]


def window_gap(a: list[float], b: list[float], window: int) -> float:
    """Largest |relative gap| of a's mean loss over `window`-step windows to b's, over the windows both complete."""
    steps = min(len(a), len(b)) // window * window
    return max(
        (
            abs(sum(a[i : i + window]) - sum(b[i : i + window])) / sum(b[i : i + window])
            for i in range(0, steps, window)
        ),
        default=0.0,
    )


def own_spread(names: tuple[str, ...], window: int) -> str:
    """The reference runs' own largest window gap to each other (how far two runs of one tree differ)."""
    if len(names) < 2:
        return "-"
    curves = [load(name)["losses"] for name in names]
    gaps = [window_gap(a, b, window) for i, a in enumerate(curves) for b in curves[i + 1 :]]
    return f"{max(gaps):.2%}"


def losses_table() -> list[str]:
    lines = [
        f"| check | steps | end loss (mean of the last {LOSS_WINDOW} steps): reference / runs "
        f"| largest gap over {LOSS_WINDOW}-step windows | reference's own runs, same measure | GPU | results |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for check in LOSSES:
        reference, runs = mean_curve(check.reference), mean_curve(check.runs)
        steps = min(len(reference), len(runs))
        end = [sum(curve[steps - LOSS_WINDOW : steps]) / LOSS_WINDOW for curve in (reference, runs)]
        first = load(check.runs[0])
        files = ", ".join(link(name) for name in (*check.reference, *check.runs))
        lines.append(
            f"| {check.label} | {steps} | {end[0]:.4f} / {end[1]:.4f} | "
            f"{window_gap(runs, reference, LOSS_WINDOW):.2%} | {own_spread(check.reference, LOSS_WINDOW)} | "
            f"{first['ngpu']} x {device(first)} | {files} |"
        )
    return [*lines, ""]


def acceptance_files() -> dict[str, dict[int, str]]:
    """row -> GPU count -> the newest top-level acceptance JSON that ran that row at that GPU count."""
    newest: dict[tuple[str, int], tuple[str, str]] = {}
    for path in sorted(RESULTS_DIR.glob("acceptance_*.json")):
        result = json.loads(path.read_text())
        for row in result["rows"]:
            if row["status"] == "skipped":
                continue
            key = (row["name"], result["ngpu"])
            if key not in newest or result["date"] > newest[key][0]:
                newest[key] = (result["date"], path.name)
    matrix: dict[str, dict[int, str]] = {}
    for (row, ngpu), (_, name) in newest.items():
        matrix.setdefault(row, {})[ngpu] = name
    return matrix


def acceptance_rows() -> list[tuple[str, str]]:
    """(name, what it changes) of every row `scripts/bench/gpu_acceptance.py` runs today, in its order."""
    from scripts.bench.gpu_acceptance import all_rows

    return [(row.name, row.why) for row in all_rows()]


def acceptance_table() -> list[str]:
    matrix = acceptance_files()
    lines = [
        "| row | what it checks | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in GPU_COUNTS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in GPU_COUNTS) + " |",
    ]
    for name, why in acceptance_rows():
        cells = []
        for ngpu in GPU_COUNTS:
            file = matrix.get(name, {}).get(ngpu)
            if file is None:
                cells.append("not run")
                continue
            result = load(file)
            row = next(row for row in result["rows"] if row["name"] == name)
            cells.append(f"{row['status']} at {commit(result)}, {device(result)} ([json](results/{file}))")
        lines.append(f"| {name} | {why} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def memory_tables() -> list[str]:
    cp = load(CP_MEMORY)
    lines = [
        f"Context parallelism at {cp['seq_len']:,} tokens per sequence, 16B_accept, compile + per-op SAC, both "
        f"ranks on one {device(cp)} (memory is real, speed is not; {link(CP_MEMORY)}, commit {commit(cp)}, "
        f"`{shown_command(cp)}`):",
        "",
        "| run | tokens per rank | peak allocated per rank (GiB) | peak reserved per rank (GiB) |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in (("cp2", "CP=2"), ("cp1", "CP=1 (FSDP=2, one sequence per rank)")):
        run = cp["runs"][key]
        cp_degree = 2 if key == "cp2" else 1
        reserved = max(rank["max_reserved_gib"] for rank in run["per_rank_peak"])
        lines.append(
            f"| {label} | {cp['seq_len'] // cp_degree:,} | {max(run['memory_allocated_gib_per_step']):.1f} | "
            f"{reserved:.1f} |"
        )
    snapshot = load(MEMORY_BREAKDOWN)
    lines += [
        "",
        f"Who holds the allocated peak of 16B_bench4 on one {device(snapshot)} (commit {commit(snapshot)}, "
        f"{link(MEMORY_BREAKDOWN)}; `scripts/bench/memory_breakdown.py` on an allocator snapshot of step 4): peak "
        f"allocated {snapshot['peak_allocated_gib']:.1f} GiB, reserved {snapshot['reserved_peak_gib']:.1f} GiB.",
        "",
        "| holder | GiB |",
        "| --- | --- |",
    ]
    for holder in snapshot["holders_at_peak"][:6]:
        lines.append(f"| `{holder['holder']}` | {holder['gib']:.1f} |")
    return [*lines, ""]


def kernels_table() -> list[str]:
    lines = [
        "| what | measured | device | commit | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in GROUPED_GEMM:
        r = load(name)
        bf16, fp8 = r["experts_compiled"]["fwd_bwd_ms"], r["experts_fp8_compiled"]["fwd_bwd_ms"]
        lines.append(
            f"| routed experts' grouped-GEMM SwiGLU, {r['layer']} shape, {r['rows']:,} rows, compiled, fwd+bwd "
            f"| FP8 {fp8:.1f} ms against bf16 {bf16:.1f} ms ({bf16 / fp8:.2f}x) | {device(r)} | {commit(r)} "
            f"| {link(name)} |"
        )
    opt = load(OPTIMIZER)
    paths = opt["paths"]
    lines.append(
        f"| AdamW step, {opt['flavor']} ({opt['num_params'] / 1e9:.1f}B parameters) "
        f"| ours {paths['ours']['ms']:.1f} ms "
        f"({paths['ours']['ratio_to_measured_bound']:.2f}x the memory-bandwidth bound), torch fused + clipping "
        f"{paths['torch_fused']['ms']:.1f} ms ({paths['torch_fused']['ratio_to_measured_bound']:.2f}x) "
        f"| {device(opt)} | {commit(opt)} | {link(OPTIMIZER)} |"
    )
    head = load(OUTPUT_HEAD)
    plain, fused = head["results"]["plain"], head["results"]["fused_chunk2048"]
    lines.append(
        f"| output head + loss, {head['rows']:,} tokens, vocab {head['vocab']:,} | fused (2,048-token chunks) "
        f"{fused['ms']:.1f} ms and +{fused['peak_above_inputs_gib']:.1f} GiB, plain {plain['ms']:.1f} ms and "
        f"+{plain['peak_above_inputs_gib']:.1f} GiB | {device(head)} | {commit(head)} | {link(OUTPUT_HEAD)} |"
    )
    bw = load(DEEPEP_BANDWIDTH)
    lines.append(
        f"| DeepEP dispatch / combine, EP={bw['ep']}, {bw['num_tokens']:,} tokens x {bw['hidden']}, "
        f"{bw['num_sms']} SMs | {bw['dispatch_gbps']:.0f} / {bw['combine_gbps']:.0f} GB/s | {device(bw)} "
        f"| {commit(bw)} | {link(DEEPEP_BANDWIDTH)} |"
    )
    return [*lines, ""]


def data_loader_table() -> list[str]:
    result = load(DATA_LOADER)
    settings = result["settings"]
    lines = [
        f"One rank's loader, `scripts/bench/data_loader.py` on {result['machine']} (no GPU; commit {commit(result)}, "
        f"{link(DATA_LOADER)}): rank 0 of {settings['dp']} data-parallel ranks, {settings['batch']} x "
        f"{settings['seq_len']} tokens a batch, {settings['batches']} batches, synthetic uint16 token shards written "
        "outside the repository. Memory: the process's resident memory after the batches over its own after imports.",
        "",
        "| corpus | tokens/s, pages cached | tokens/s, pages evicted first | launch to first batch (s) "
        "| resident memory growth (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size in result["sizes"]:
        warm, cold = size["warm"], size["cold"]
        lines.append(
            f"| {size['gib_of_tokens']:g} GiB ({size['tokens'] / 1e9:.2f}B tokens) | "
            f"{warm['tokens_per_second'] / 1e6:.1f}M | {cold['tokens_per_second'] / 1e6:.1f}M | "
            f"{warm['seconds_launch_to_first_batch']:.2f} | {warm['rss_growth_mib']:.0f} |"
        )
    if runs := result.get("tokenizer"):
        lines += [
            "",
            f"`scripts/tokenize_corpus.py` on {runs[0]['text_mb']} MB of text (the shipped corpus repeated, the "
            "shipped tokenizer, encoded by tiktoken and checked against `tokenizers`):",
            "",
            "| workers | MB/s of text per worker | peak resident memory per worker (MiB) |",
            "| --- | --- | --- |",
            *(f"| {r['workers']} | {r['mb_per_s_per_worker']} | {r['peak_rss_mib_per_worker']} |" for r in runs),
        ]
    return [*lines, ""]


def render() -> str:
    lines = [
        "# Results",
        "",
        "The latest measured figure of every benchmark row. Generated by `python scripts/bench/results_table.py`",
        "from the JSONs in `benchmarks/results/` that each row links (each holds the exact command, device, torch",
        "version and commit); do not edit by hand. How the figures were reached, and everything superseded:",
        "[NOTES.md](NOTES.md) and `benchmarks/results/archive/`. MFU counts the device's dense bf16 peak (989",
        "TFLOP/s on H100 and H200). Ratios are taken only between runs on one machine, back to back: two machines of",
        "one kind differ by up to 10%. Commands are shown as they run today (a flag renamed since a run by its new",
        "name; the JSON keeps the command as run).",
        "",
        "![tokens/s per GPU](plots/tokens_per_sec.png)",
        "",
        "## 16B_bench4: throughput and memory",
        "",
        "The DeepSeek-V3 16B layer shapes with 8 layers (4.6B parameters), compile + per-op SAC, the router's own",
        "routing, 4 x 4096 tokens per GPU, median of the steady steps; DeepEP with 64 SMs (the default) unless marked.",
        "",
        *runs_table(BENCH4),
        "![memory per GPU](plots/memory.png)",
        "",
        "## The whole 16B (27 layers)",
        "",
        "The 16B job's settings (`train_configs/deepseek_v3_16b.toml`), 4 x 4096 tokens per GPU.",
        "",
        *runs_table(WHOLE_16B),
        "## Other models",
        "",
        "Qwen3-MoE's proxy (`train_configs/qwen3_30b_a3b.toml --model.flavor 30B-A3B_bench8`): 30B-A3B's layers",
        "(GQA with q/k norms, 128 experts, top-8, no shared expert), 4 x 4096 tokens per GPU.",
        "",
        *runs_table(OTHER_MODELS),
        "## Loss curves",
        "",
        "Mean curve of the runs against the mean curve of the reference runs; the last column but two is how far",
        "two runs of the reference differ by the same measure (with the router's own routing, one tree's runs",
        "differ too).",
        "",
        *losses_table(),
        "![300-step loss curves](plots/loss_300steps.png)",
        "",
        "## GPU acceptance: where each feature trained on GPUs",
        "",
        "`python scripts/bench/gpu_acceptance.py` trains each row against a base run on the same machine",
        "(16B_accept: the 16B layer shapes, 3 layers; 12 steps; FSDP x EP over every GPU, deepep + compile +",
        "per-op SAC). Each cell is the newest run of that row at that GPU count; bounds are in the script.",
        "",
        *acceptance_table(),
        "## Memory",
        "",
        *memory_tables(),
        "## Kernels",
        "",
        *kernels_table(),
        "## Data loader",
        "",
        *data_loader_table(),
    ]
    return "\n".join(lines)


def plot(path: Path, runs: tuple[Run, ...], values, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{run.label} ({device(load(run.file))}, {commit(load(run.file))})" for run in runs]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(labels) + 1.2))
    for offset, (name, series) in enumerate(values.items()):
        positions = [i + 0.4 * offset for i in range(len(labels))]
        bars = ax.barh(positions, series, height=0.4, label=name)
        ax.bar_label(bars, fmt="{:,.1f}", padding=2, fontsize=7)
    ax.set_yticks([i + 0.2 * (len(values) - 1) for i in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if len(values) > 1:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(path: Path, check: LossCheck) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = mean_curve(check.reference)
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for name in (*check.reference, *check.runs):
        losses = load(name)["losses"]
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, linewidth=0.8, label=Path(name).stem)
        gap.plot(steps, [(a - b) / b * 100 for a, b in zip(losses, reference, strict=False)], linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.set_title(check.label, fontsize=9)
    ax.legend(fontsize=7)
    gap.set_ylabel("vs reference mean (%)")
    gap.set_xlabel("step")
    for axis in (ax, gap):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots() -> None:
    PLOTS_DIR.mkdir(exist_ok=True)
    runs = BENCH4 + WHOLE_16B
    results = [load(run.file) for run in runs]
    speed = {"ours": [r["tokens_per_sec_per_gpu"] / 1e3 for r in results]}
    if any(run.upstream for run in runs):
        speed["upstream torchtitan, same call"] = [
            load(run.upstream)["tokens_per_sec_per_gpu"] / 1e3 if run.upstream else 0.0 for run in runs
        ]
    plot(PLOTS_DIR / "tokens_per_sec.png", runs, speed, "thousand tokens / s / GPU")
    memory = {
        "reserved": [r["peak_memory_gib"] for r in results],
        "allocated": [r.get("peak_memory_allocated_gib") or 0.0 for r in results],
    }
    plot(PLOTS_DIR / "memory.png", runs, memory, "peak GiB per GPU")
    plot_losses(PLOTS_DIR / "loss_300steps.png", LOSSES[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plots", action="store_true", help="also write benchmarks/plots/*.png (needs matplotlib)")
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md differs from the generated text")
    args = parser.parse_args()
    text = render() + "\n"
    if args.check:
        if RESULTS_MD.read_text() != text:
            sys.exit("error: benchmarks/RESULTS.md is stale: run python scripts/bench/results_table.py")
        return
    RESULTS_MD.write_text(text)
    if args.plots:
        write_plots()


if __name__ == "__main__":
    main()
