"""What holds GPU memory at the peak: a summary of a CUDA allocator snapshot.

    python scripts/bench/memory_breakdown.py <dump>/memory_snapshot/iteration_8/rank0_memory_snapshot.pickle

Snapshots come from `--profiling.enable_memory_snapshot` (torchtitan/tools/profiling.py). The allocator's trace is
replayed to the moment of peak allocated memory; the tensors alive then are grouped by the innermost frame of our
code (`torchtitan/`, `scripts/`) that allocated them, or by the innermost frame at all when none is ours. Reserved
memory is tracked per CUDA stream over the same trace: each stream has its own pool in the caching allocator, so
memory freed on one stream does not serve another, and the sum of the streams' peaks is what a job reserves.

Prints a table and writes JSON (`--out`): peak allocated, its top holders, reserved per stream.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from pathlib import Path

GIB = 1024**3
OUR_CODE = ("torchtitan/", "scripts/")
LIBRARY_CALLERS = {"torch/distributed/fsdp/": "FSDP", "torch/utils/checkpoint.py": "checkpoint"}
"""Library code whose allocations are labelled as such: FSDP's buffers are allocated under our modules' frames."""
_ALLOCS = {"alloc"}
_FREES = {"free_completed"}
_SEGMENT_GROWS = {"segment_alloc", "segment_map"}
_SEGMENT_SHRINKS = {"segment_free", "segment_unmap"}


def holder(frames: list[dict] | None) -> str:
    """Who allocated a block: the innermost frame of our code, else the innermost frame; 'unknown' without frames
    (allocated before recording started and freed inside the trace window)."""
    if not frames:
        return "unknown (allocated before the trace window)"
    via = ""
    for frame in frames:
        library = next((label for path, label in LIBRARY_CALLERS.items() if path in frame["filename"]), None)
        if library:
            via = f" [{library} {frame['name']}]"
            break
    return _our_frame(frames) + via


def _our_frame(frames: list[dict]) -> str:
    for frame in frames:
        filename = frame["filename"]
        for root in OUR_CODE:
            if root in filename:
                return f"{root}{filename.split(root, 1)[1]}:{frame['line']} {frame['name']}"
    frame = frames[0]
    return f"{frame['filename']}:{frame['line']} {frame['name']}"


def _live_blocks_at_end(snapshot: dict, device: int) -> dict[int, tuple[int, list | None]]:
    """address -> (size, frames) of every allocated block when the snapshot was taken."""
    live = {}
    for segment in snapshot["segments"]:
        if segment["device"] != device:
            continue
        for block in segment["blocks"]:
            if block["state"] in ("active_allocated", "active_pending_free"):
                live[block["address"]] = (block["size"], block.get("frames"))
    return live


def analyse(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    """Replay `snapshot`'s trace for `device`: the peak of allocated bytes, who holds it, reserved per stream."""
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []  # no history recorded: the state at the end only
    end_live = _live_blocks_at_end(snapshot, device)

    # Walk back from the end to the live set at the start of the trace window.
    live = dict(end_live)
    for event in reversed(trace):
        if event["action"] in _ALLOCS:
            live.pop(event["addr"], None)
        elif event["action"] in _FREES:
            live[event["addr"]] = (event["size"], None)

    reserved_end: dict[int, int] = defaultdict(int)
    for segment in snapshot["segments"]:
        if segment["device"] == device:
            reserved_end[segment["stream"]] += segment["total_size"]
    net_segment_change: dict[int, int] = defaultdict(int)
    for event in trace:
        if event["action"] in _SEGMENT_GROWS:
            net_segment_change[event["stream"]] += event["size"]
        elif event["action"] in _SEGMENT_SHRINKS:
            net_segment_change[event["stream"]] -= event["size"]
    reserved = {
        s: reserved_end.get(s, 0) - net_segment_change.get(s, 0) for s in set(reserved_end) | set(net_segment_change)
    }
    reserved_peak = dict(reserved)
    total_reserved_peak = sum(reserved.values())

    allocated = sum(size for size, _ in live.values())
    peak, peak_live, peak_index = allocated, dict(live), -1
    allocations_by_stream: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for index, event in enumerate(trace):
        action = event["action"]
        if action in _ALLOCS:
            live[event["addr"]] = (event["size"], event.get("frames"))
            allocations_by_stream[event["stream"]][holder(event.get("frames"))] += event["size"]
            allocated += event["size"]
            if allocated > peak:
                peak, peak_live, peak_index = allocated, dict(live), index
        elif action in _FREES:
            if live.pop(event["addr"], None) is not None:
                allocated -= event["size"]
        elif action in _SEGMENT_GROWS or action in _SEGMENT_SHRINKS:
            sign = 1 if action in _SEGMENT_GROWS else -1
            reserved[event["stream"]] = reserved.get(event["stream"], 0) + sign * event["size"]
            reserved_peak[event["stream"]] = max(reserved_peak.get(event["stream"], 0), reserved[event["stream"]])
            total_reserved_peak = max(total_reserved_peak, sum(reserved.values()))

    by_holder: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in peak_live.values():
        entry = by_holder[holder(frames)]
        entry[0] += size
        entry[1] += 1
    holders = sorted(by_holder.items(), key=lambda item: -item[1][0])
    return {
        "trace_events": len(trace),
        "peak_allocated_gib": peak / GIB,
        "peak_event_index": peak_index,
        "allocated_at_end_gib": sum(size for size, _ in end_live.values()) / GIB,
        "reserved_peak_gib": total_reserved_peak / GIB,
        "reserved_peak_by_stream_gib": {str(s): v / GIB for s, v in sorted(reserved_peak.items())},
        "allocations_by_stream": {  # what each stream allocated over the trace window, the largest first
            str(stream): [
                {"holder": name, "gib": size / GIB}
                for name, size in sorted(by_holder.items(), key=lambda item: -item[1])[:5]
            ]
            for stream, by_holder in sorted(allocations_by_stream.items())
        },
        "holders_at_peak": [
            {"holder": name, "gib": size / GIB, "blocks": count} for name, (size, count) in holders[:top]
        ],
        "other_holders_gib": sum(size for _, (size, _) in holders[top:]) / GIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        summary = analyse(pickle.load(f), args.device, args.top)
    summary["snapshot"] = str(args.snapshot)
    print(
        f"peak allocated {summary['peak_allocated_gib']:.2f} GiB (trace event {summary['peak_event_index']} of "
        f"{summary['trace_events']}), reserved peak {summary['reserved_peak_gib']:.2f} GiB"
    )
    for stream, gib in summary["reserved_peak_by_stream_gib"].items():
        print(f"  stream {stream}: reserved peak {gib:.2f} GiB")
        for row in summary["allocations_by_stream"].get(stream, [])[:3]:
            print(f"      allocated {row['gib']:8.2f} GiB over the window by {row['holder']}")
    for row in summary["holders_at_peak"]:
        print(f"{row['gib']:8.2f} GiB {row['blocks']:6d} blocks  {row['holder']}")
    print(f"{summary['other_holders_gib']:8.2f} GiB in other holders")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
