"""Where each rank's step went: compute, exposed exchange, exposed FSDP collectives, waiting for other ranks, idle.

    python scripts/bench/rank_profile.py <dump>/profile_traces/iteration_12     # every rank<R>_trace.json in it

Each rank's recorded step (the device work launched inside its `ProfilerStep#`, `tools/profiling.py`) is cut into
disjoint time segments, each given to the first of these that has a kernel running in it:

    compute          any kernel that is not communication (GEMMs, attention, elementwise, optimizer, ...)
    exchange         the expert-parallel token exchange: DeepEP's dispatch/combine, NCCL all-to-all (SendRecv)
    exchange_wait    DeepEP's notify kernels: a barrier with the other EP ranks before each dispatch and combine;
                     exposed time there is time this rank arrived first and waited for the slowest one
    fsdp             NCCL all-gather and reduce-scatter (FSDP's parameters and gradients)
    other_collective any other NCCL kernel (all-reduces of the loss, the gradient norm, the expert counts)
    idle             no kernel at all (the device waited for the host)

so compute + the exposed classes + idle = the step's device span. `hidden_ms` gives the communication that ran
under compute (overlapped, free). A rank whose exposed exchange_wait is large ran ahead of the others; the others'
extra compute (`grouped_gemm_ms`: the routed experts, i.e. the tokens that rank received) says why.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.trace_breakdown import classify, read_gpu_trace  # noqa: E402
from torchtitan.tools.profiling import profiled_steps  # noqa: E402

SEGMENT_CLASSES = ("compute", "exchange", "exchange_wait", "fsdp", "other_collective")
"""Priority order: a segment where several run belongs to the first (compute hides communication)."""
COMMUNICATION = SEGMENT_CLASSES[1:]

_WAIT = re.compile(r"deep_ep.*notify")
_EXCHANGE = re.compile(r"deep_ep|sendrecv|all_?to_?all")
_FSDP = re.compile(r"all_?gather|reduce_?scatter")


def segment_class(kernel_name: str) -> str:
    """The `SEGMENT_CLASSES` entry of one device event (kernel, copy, memset) by its name."""
    name = kernel_name.lower()
    if _WAIT.search(name):
        return "exchange_wait"
    if _EXCHANGE.search(name):
        return "exchange"
    if classify(kernel_name) != "communication":
        return "compute"
    return "fsdp" if _FSDP.search(name) else "other_collective"


def step_attribution(device_events: list[dict]) -> dict:
    """One rank's step (its device events) -> span, the disjoint time per class, idle, and communication hidden under
    compute, in ms."""
    priority = {cls: i for i, cls in enumerate(SEGMENT_CLASSES)}
    indices = [priority[segment_class(event["name"])] for event in device_events]
    edges = []  # (time, +1/-1, class index)
    for event, index in zip(device_events, indices, strict=True):
        edges += [(event["ts"], 1, index), (event["ts"] + event["dur"], -1, index)]
    edges.sort(key=lambda e: (e[0], e[1]))  # at one instant, ends before starts
    active = [0] * len(SEGMENT_CLASSES)
    exposed = [0.0] * len(SEGMENT_CLASSES)
    hidden = [0.0] * len(SEGMENT_CLASSES)  # communication running while compute runs
    idle, last = 0.0, edges[0][0] if edges else 0.0
    for time, change, index in edges:
        length = time - last
        if length > 0:
            running = [i for i, n in enumerate(active) if n > 0]
            if not running:
                idle += length
            else:
                exposed[running[0]] += length
                if running[0] == 0:
                    for i in running[1:]:
                        hidden[i] += length
        active[index] += change
        last = time
    span = edges[-1][0] - edges[0][0] if edges else 0.0
    return {
        "span_ms": span / 1e3,
        "idle_ms": idle / 1e3,
        "exposed_ms": {cls: exposed[i] / 1e3 for i, cls in enumerate(SEGMENT_CLASSES)},
        "hidden_ms": {cls: hidden[i] / 1e3 for i, cls in enumerate(SEGMENT_CLASSES) if i > 0},
        "grouped_gemm_ms": sum(e["dur"] for e in device_events if classify(e["name"]) == "grouped_gemm") / 1e3,
        "deepep_notify_launches": indices.count(priority["exchange_wait"]),
    }


def rank_profile(traces: dict[int, dict]) -> dict:
    """{rank: chrome trace} -> per rank, the attribution of its last recorded step, and a summary across ranks."""
    ranks = {}
    for rank, trace in sorted(traces.items()):
        steps, _ = profiled_steps(trace)
        if steps:
            ranks[rank] = {"step": steps[-1].name, **step_attribution(steps[-1].device_events)}
    if not ranks:
        return {"ranks": {}}
    exposed_comm = {r: sum(a["exposed_ms"][c] for c in COMMUNICATION) for r, a in ranks.items()}
    compute = {r: a["exposed_ms"]["compute"] for r, a in ranks.items()}
    experts = {r: a["grouped_gemm_ms"] for r, a in ranks.items()}
    return {
        "ranks": {str(r): a for r, a in ranks.items()},
        "summary": {
            "span_ms_max": max(a["span_ms"] for a in ranks.values()),
            "compute_ms_max_minus_min": max(compute.values()) - min(compute.values()),
            "grouped_gemm_ms_max_over_mean": max(experts.values()) / (sum(experts.values()) / len(experts))
            if any(experts.values())
            else None,
            "exposed_communication_ms_mean": sum(exposed_comm.values()) / len(exposed_comm),
            "exposed_wait_ms_mean": sum(a["exposed_ms"]["exchange_wait"] for a in ranks.values()) / len(ranks),
            "idle_ms_mean": sum(a["idle_ms"] for a in ranks.values()) / len(ranks),
        },
    }


def read_traces(folder: Path) -> dict[int, dict]:
    """The rank<R>_trace.json files of one profiled iteration's folder, by rank; exits with one line where there are
    none, or one cannot be read or is a CPU run's (`read_gpu_trace`)."""
    paths = sorted(folder.glob("rank*_trace.json"))
    if not paths:
        sys.exit(
            f"error: {folder} holds no rank<R>_trace.json; pass a profiled iteration's folder "
            "(<dump>/profile_traces/iteration_N)"
        )
    rank = {path: int(path.name.removeprefix("rank").split("_")[0]) for path in paths}
    return {rank[path]: read_gpu_trace(path, "rank_profile.py") for path in paths}


def markdown_table(profile: dict) -> list[str]:
    lines = [
        "| rank | span ms | compute | exchange | exchange wait | FSDP | other coll. | idle | hidden comm | experts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rank, a in profile["ranks"].items():
        e = a["exposed_ms"]
        lines.append(
            f"| {rank} | {a['span_ms']:.1f} | {e['compute']:.1f} | {e['exchange']:.1f} | {e['exchange_wait']:.1f} | "
            f"{e['fsdp']:.1f} | {e['other_collective']:.1f} | {a['idle_ms']:.1f} | "
            f"{sum(a['hidden_ms'].values()):.1f} | {a['grouped_gemm_ms']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a profiled iteration's folder (rank<R>_trace.json files)")
    parser.add_argument("--json", type=Path, help="also write the attribution here")
    args = parser.parse_args()
    profile = rank_profile(read_traces(args.folder))
    print("\n".join(markdown_table(profile)))
    if args.json:
        args.json.write_text(json.dumps(profile, indent=1) + "\n")


if __name__ == "__main__":
    main()
