"""Where a training step's device time goes: the kernels launched inside each recorded step of a chrome trace, by
class, each class with its achieved TFLOP/s or GB/s next to the device's bound, and the device's idle time.

    python scripts/bench/trace_breakdown.py <dump>/profile_traces/iteration_10/rank0_trace.json
    python scripts/bench/trace_breakdown.py TRACE --add-to benchmarks/results/e2e_<name>.json   # a run's result

Works on any `export_chrome_trace` file, also one an older tree wrote (`e2e.py --profile-step N` runs it itself).

Attribution: a kernel (copy, memset) belongs to the `ProfilerStep#<n>` whose host range holds the runtime call that
launched it (same `correlation` id), wherever it ran on the device; kernels still queued from before the recording
started are reported apart (`device_ms_launched_outside_steps`), never spread over the step. A step's device span
runs from its first kernel's start to its last kernel's end; idle = span - the union of its kernels' intervals (of
every stream); kernels on overlapping streams add up in `kernel_ms` (`overlap_ms` = kernel_ms - busy_ms).

FLOPs come from the host op that launched a kernel (the innermost enclosing op on the launching thread that has
FLOPs; an op's FLOPs go to the longest kernel it launched): the profiler's or Inductor's own count (`flops`,
`kernel_flop`), else torch's formulas (`torch.utils.flop_counter`) on the op's recorded input shapes (the trainer
records shapes from issue 36 on; older traces have none), halved for causal attention; `aten::_grouped_mm` is
counted here (2 x rows x K x N over the groups, padding rows included). Bytes come from memcpy/memset events and from
Inductor's kernels (their launch records every buffer they take: each counted once, read or written); other kernels'
bytes are unknown, so their class's GB/s is null. A class's TFLOP/s (GB/s) is over its kernels with known FLOPs
(bytes): `flop_known_pct` (`bytes_known_pct`) says what share of its time that is. Bounds: the device's dense bf16
peak for GEMMs and attention (also FP8 GEMMs: their % of bound can pass 100), its HBM bandwidth for the memory-bound
classes, none for communication (link traffic is not in the trace) and "other".

Host waits (`host_waits`): the CUDA calls inside the step that held the host until the device got there (a
synchronize, a pageable copy), with the outermost host op each ran in and its input shapes. `host_ms` minus their
sum is the host's own work: when that is close to the kernels' busy time, the step is host-bound, and a wait empties
the device's queue, so the work launched after it starts on an idle device.

Idle gaps (`idle_gaps`, the longest of each step): the kernel before and after each gap, when the kernel after it was
launched relative to the gap's start (after it: the device waited for the host; before it: for something else,
another stream or an event), the host op it was launched from, and the outermost host ops that ran on the launching
thread while the device waited (what the host was busy with: a data loader, a sync, Python between kernels).
"""

import argparse
import functools
import inspect
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torchtitan.tools.profiling import DEVICE_EVENTS, RUNTIME_CALLS, ProfiledStep, profiled_steps  # noqa: E402

_INDUCTOR = r"^triton_(poi|per|red|for)_"  # Inductor's generated kernels, named after every op fused into them
_LAYOUT_OPS = (
    r"_?(to_copy|copy|clone|transpose|permute|view|unsafe_view|expand|t|cat|slice|select|squeeze|unsqueeze|reshape"
    r"|constant_pad_nd|grouped_mm|mm|bmm|addmm|scaled_mm|scaled_grouped_mm)_"
)
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|deep_ep|nvshmem|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"),
    ("optimizer", r"adam|multi_tensor_apply|_sum_of_squares_kernel|foreach"),
    # An Inductor kernel is also named after the GEMM its output feeds (`triton_poi_fused__grouped_mm__to_copy_0`
    # casts a weight for it): one of layout ops and casts only is a cast, whatever GEMM it names.
    ("casts_copies", _INDUCTOR + rf"fused_({_LAYOUT_OPS})+\d+$"),
    ("moe_glue", _INDUCTOR + r".*(scatter|gather|index|sort|histc|topk|bincount|cumsum|searchsorted|nonzero)"),
    ("norms_elementwise", _INDUCTOR),
    ("attention_bwd", r"^(?=.*(flash|fmha|attention|attn|sdpa|flex))(?=.*(bwd|backward|bprop|cutlassb))"),
    ("attention_fwd", r"flash|fmha|attention|attn|sdpa|flex"),
    ("grouped_gemm", r"grouped|groupproblemshape|ptr_?array|group_?gemm"),
    ("dense_gemm", r"nvjet|xmma|gemm|gemv|cutlass|cublas|splitkreduce|^triton_tem_fused_(add)?b?mm"),
    ("casts_copies", r"memcpy|memset|copy|(?<!no)cast|convert|_rowwise_kernel|_columns_per_group_kernel|_tile_column"),
    ("moe_glue", r"scatter|gather|index|sort|histc|histogram|topk|bincount|cumsum|scan|searchsorted|nonzero|unpermute"),
    ("norms_elementwise", r"norm|rms|elementwise|reduce|softmax|silu|sigmoid|exp|pow|add|mul"),
)
"""(class, pattern searched in the lower-cased kernel name); the first match wins, "other" when none does."""
CLASSES = (
    "grouped_gemm", "dense_gemm", "attention_fwd", "attention_bwd", "optimizer", "casts_copies", "moe_glue",
    "norms_elementwise", "communication", "other",
)  # fmt: skip
COMPUTE_BOUND = ("grouped_gemm", "dense_gemm", "attention_fwd", "attention_bwd")
MEMORY_BOUND = ("optimizer", "casts_copies", "moe_glue", "norms_elementwise")

# HBM bandwidth (bytes/s) per device, matched by substring of the device name, first match wins.
HBM_BYTES_PER_S: tuple[tuple[str, float], ...] = (
    ("A100", 2.0e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("H200", 4.8e12),
    ("B200", 8.0e12),
)

_KERNEL_CLASS_PATTERNS = tuple((name, re.compile(pattern)) for name, pattern in KERNEL_CLASSES)
_LAUNCH = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memcpy|Memset)")
_DTYPE_BYTES = {
    "c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
    "c10::Float8_e8m0fnu": 1,
}  # fmt: skip


def breakdown(trace: dict, device_name: str | None = None) -> dict:
    """Per recorded step of a chrome trace: its device time by class (see the module docstring), idle and span."""
    device_name = device_name or next((d["name"] for d in trace.get("deviceProperties", [])), None)
    peak_flop_per_s = hbm_bytes_per_s = None
    if device_name:
        from torchtitan.components.metrics import get_peak_flops

        peak_flop_per_s = get_peak_flops(device_name)
        hbm_bytes_per_s = next((bw for part, bw in HBM_BYTES_PER_S if part in device_name), None)
    steps, outside = profiled_steps(trace)
    flop, nbytes = work_of_device_events(trace)
    host = host_ops_by_thread(trace)
    return {
        "device_name": device_name,
        "peak_bf16_tflop_per_s": peak_flop_per_s and peak_flop_per_s / 1e12,
        "hbm_gb_per_s": hbm_bytes_per_s and hbm_bytes_per_s / 1e9,
        "device_ms_launched_outside_steps": sum(e["dur"] for e in outside) / 1e3,
        "steps": [step_breakdown(step, flop, nbytes, peak_flop_per_s, hbm_bytes_per_s, host) for step in steps],
    }


@functools.cache
def classify(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((cls for cls, pattern in _KERNEL_CLASS_PATTERNS if pattern.search(name)), "other")


def step_breakdown(
    step: ProfiledStep,
    flop: dict,
    nbytes: dict,
    peak_flop_per_s: float | None,
    hbm_bytes_per_s: float | None,
    host: dict | None = None,
) -> dict:
    events = step.device_events
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    span_us = max(end for _, end in intervals) - intervals[0][0] if intervals else 0.0
    busy_us = _union_length(intervals)
    kernel_us = sum(e["dur"] for e in events)
    launched = {e["args"]["correlation"] for e in events}
    lost = [c for c in step.runtime_calls if _LAUNCH.match(c["name"]) and c["args"]["correlation"] not in launched]
    by_class = defaultdict(list)
    for event in events:
        by_class[classify(event["name"])].append(event)
    bounds = {
        **dict.fromkeys(COMPUTE_BOUND, peak_flop_per_s and {"kind": "compute", "tflop_per_s": peak_flop_per_s / 1e12}),
        **dict.fromkeys(MEMORY_BOUND, hbm_bytes_per_s and {"kind": "memory", "gb_per_s": hbm_bytes_per_s / 1e9}),
    }
    return {
        "name": step.name,
        "host_ms": (step.end_us - step.start_us) / 1e3,
        "span_ms": span_us / 1e3,
        "kernel_ms": kernel_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": (span_us - busy_us) / 1e3,
        "idle_pct_of_span": 100.0 * (span_us - busy_us) / span_us if span_us else 0.0,
        "overlap_ms": (kernel_us - busy_us) / 1e3,
        "launches": len(events),
        "launches_without_device_event": len(lost),  # > 0: the trace lost kernels (it stopped before they ran)
        "classes": {
            cls: class_breakdown(by_class.get(cls, []), span_us, flop, nbytes, bounds.get(cls)) for cls in CLASSES
        },
        "host_wait_ms": sum(call["dur"] for call in step.blocking_calls()) / 1e3,
        "host_waits": host_waits(step, host or {}),
        "idle_gaps": idle_gaps(step, host or {}),
    }


def host_ops_by_thread(trace: dict) -> dict[tuple, list[tuple[dict, int]]]:
    """(pid, tid) -> the thread's host ops and annotations as (event, depth), sorted by start; depth counts the
    enclosing ops, `ProfilerStep#` ranges left out (so 0 is the outermost op inside a step)."""
    threads = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in ("cpu_op", "user_annotation"):
            threads[(event["pid"], event["tid"])].append(event)
    result = {}
    for key, events in threads.items():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, with_depth = [], []
        for event in events:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            if event["name"].startswith("ProfilerStep#"):
                continue
            with_depth.append((event, len(stack)))
            stack.append(event)
        result[key] = with_depth
    return result


def host_waits(step: ProfiledStep, host: dict, top: int = 5) -> list[dict]:
    """The step's `top` longest blocking CUDA calls, longest first, each with the outermost host op it ran in."""
    waits = []
    for call in step.blocking_calls():
        enclosing = _enclosing_ops(host, call)
        outer = enclosing[0] if enclosing else None
        waits.append(
            {
                "ms": call["dur"] / 1e3,
                "call": call["name"],
                "op": outer["name"][:120] if outer else None,
                "op_input_dims": outer.get("args", {}).get("Input Dims") if outer else None,
            }
        )
    return sorted(waits, key=lambda w: -w["ms"])[:top]


def idle_gaps(step: ProfiledStep, host: dict, top: int = 5) -> list[dict]:
    """The step's `top` longest device-idle gaps (no kernel on any stream), longest first (module docstring)."""
    events = sorted(step.device_events, key=lambda e: e["ts"])
    launches = {c["args"]["correlation"]: c for c in step.runtime_calls}
    gaps, reach, last = [], -math.inf, None
    for event in events:
        if last is not None and event["ts"] > reach:
            gaps.append((event["ts"] - reach, reach, last, event))
        if event["ts"] + event["dur"] > reach:
            reach, last = event["ts"] + event["dur"], event
    result = []
    for idle_us, start, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = launches.get(after["args"].get("correlation"))
        ops = host.get((launch["pid"], launch["tid"]), []) if launch else []
        launched_inside = _enclosing_ops(host, launch) if launch else []
        window_end = min(after["ts"], launch["ts"]) if launch else start
        busy = []
        for event, depth in ops:
            overlap = min(event["ts"] + event["dur"], window_end) - max(event["ts"], start)
            if depth == 0 and overlap > 0:
                busy.append({"op": event["name"][:120], "ms": overlap / 1e3})
        result.append(
            {
                "ms": idle_us / 1e3,
                "after_kernel": before["name"][:120],
                "before_kernel": after["name"][:120],
                "launched_ms_after_gap_start": None if launch is None else (launch["ts"] - start) / 1e3,
                "launched_inside": launched_inside[-1]["name"][:120] if launched_inside else None,
                "host_during_gap": sorted(busy, key=lambda b: -b["ms"])[:3],
            }
        )
    return result


def class_breakdown(events: list[dict], span_us: float, flop: dict, nbytes: dict, bound: dict | None) -> dict:
    us = sum(e["dur"] for e in events)
    flop_us = sum(e["dur"] for e in events if id(e) in flop)
    bytes_us = sum(e["dur"] for e in events if id(e) in nbytes)
    total_flop = sum(flop.get(id(e), 0.0) for e in events)
    total_bytes = sum(nbytes.get(id(e), 0.0) for e in events)
    tflop_per_s = total_flop / flop_us / 1e6 if flop_us else None
    gb_per_s = total_bytes / bytes_us / 1e3 if bytes_us else None
    achieved, peak = (tflop_per_s, "tflop_per_s") if bound and bound["kind"] == "compute" else (gb_per_s, "gb_per_s")
    kernels = defaultdict(lambda: [0.0, 0])
    for e in events:
        kernels[e["name"]][0] += e["dur"] / 1e3
        kernels[e["name"]][1] += 1
    return {
        "ms": us / 1e3,
        "launches": len(events),
        "pct_of_span": 100.0 * us / span_us if span_us else 0.0,
        "tflop": total_flop / 1e12 if flop_us else None,
        "tflop_per_s": tflop_per_s,
        "flop_known_pct": 100.0 * flop_us / us if us else None,
        "gb": total_bytes / 1e9 if bytes_us else None,
        "gb_per_s": gb_per_s,
        "bytes_known_pct": 100.0 * bytes_us / us if us else None,
        "bound": bound,
        "pct_of_bound": 100.0 * achieved / bound[peak] if bound and achieved is not None else None,
        "top": [
            {"name": name[:160], "ms": ms, "launches": n}
            for name, (ms, n) in sorted(kernels.items(), key=lambda item: -item[1][0])[:3]
        ],
    }


def work_of_device_events(trace: dict) -> tuple[dict[int, float], dict[int, float]]:
    """FLOPs and bytes of the trace's device events that have them, keyed by `id(event)` (see the module docstring)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launched = defaultdict(list)  # correlation id -> device events
    nbytes = {}
    for event in events:
        if event.get("cat") in DEVICE_EVENTS:
            launched[event["args"].get("correlation")].append(event)
            if "bytes" in event["args"]:  # memcpy, memset
                nbytes[id(event)] = float(event["args"]["bytes"])
    threads = defaultdict(list)
    for event in events:
        if event.get("cat") == "cpu_op" or (event.get("cat") in RUNTIME_CALLS and "correlation" in event["args"]):
            threads[(event["pid"], event["tid"])].append(event)
    op_flop, flop_op_kernels = {}, defaultdict(list)  # id(op) -> its FLOPs | the kernels launched inside it
    for thread in threads.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))  # an op before what it encloses
        stack = []  # the ops enclosing the current event, innermost last
        for event in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            if event["cat"] == "cpu_op":
                stack.append(event)
                continue
            kernels = launched.get(event["args"]["correlation"], [])
            if not kernels or not stack:
                continue
            for op in reversed(stack):
                if id(op) not in op_flop:
                    op_flop[id(op)] = op_flops(op)
                if op_flop[id(op)]:
                    flop_op_kernels[id(op)] += kernels
                    break
            innermost = stack[-1]
            for kernel in kernels:
                if innermost["name"] == kernel["name"]:  # an Inductor kernel's launch, which records its buffers
                    moved = inductor_kernel_bytes(innermost)
                    if moved is not None:
                        nbytes[id(kernel)] = moved
    flop = {}
    for op_id, kernels in flop_op_kernels.items():
        longest = max(kernels, key=lambda e: e["dur"])
        flop[id(longest)] = flop.get(id(longest), 0.0) + op_flop[op_id]
    return flop, nbytes


def op_flops(op: dict) -> float | None:
    """FLOPs of one host op of the trace; None where the trace cannot tell."""
    args = op.get("args", {})
    if args.get("flops") or args.get("kernel_flop"):
        return float(args.get("flops") or args["kernel_flop"])
    dims = args.get("Input Dims")
    if dims is None or not op["name"].startswith("aten::"):
        return None
    name = op["name"].removeprefix("aten::")
    if name in ("_grouped_mm", "_scaled_grouped_mm"):
        return grouped_mm_flops(dims[0], dims[1])
    formula = _flop_formula(name)
    if formula is None:
        return None
    flops = _shape_flops(name, _frozen(dims[: formula[1]]))
    concrete, causal_arg = args.get("Concrete Inputs", []), formula[2]
    causal = causal_arg is not None and causal_arg < len(concrete) and concrete[causal_arg] == "True"
    return flops / 2 if flops and causal else flops


@functools.cache
def _flop_formula(name: str) -> tuple | None:
    """torch's FLOP formula of an aten op (`torch.utils.flop_counter`), how many of the op's arguments it takes, and
    where the op's `is_causal` argument is (None: it has none); None where torch has no formula."""
    import torch
    from torch.utils.flop_counter import flop_registry

    packet = getattr(torch.ops.aten, name, None)
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    params = inspect.signature(formula).parameters.values()
    takes = sum(p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "out_shape" for p in params)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        takes = None  # the op's every argument
    arguments = [a.name for a in packet.default._schema.arguments]
    return formula, takes, arguments.index("is_causal") if "is_causal" in arguments else None


@functools.cache
def _shape_flops(name: str, dims: tuple) -> float | None:
    try:
        return float(_flop_formula(name)[0](*dims))
    except Exception:  # a formula that needs more than shapes (variable-length attention reads its offsets' values)
        return None


def _frozen(dims: list) -> tuple:
    return tuple(_frozen(d) if isinstance(d, list) else d for d in dims)


def grouped_mm_flops(a: list[int], b: list[int]) -> float | None:
    """2 x M x K x N summed over the groups of `_grouped_mm(a, b, offs)`, from the operands' shapes."""
    if len(a) == 2 and len(b) == 3:  # (rows, K) x (groups, K, N): the experts' forward and input gradient
        return 2.0 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # (M, rows) x (rows, N), the groups split the rows: the weight gradient
        return 2.0 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:  # (groups, M, K) x (groups, K, N)
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 3 and len(b) == 2:  # (groups, M, K) x (K, N), the groups split N
        return 2.0 * a[1] * a[2] * b[1]
    return None


def inductor_kernel_bytes(launch: dict) -> float | None:
    """Bytes an Inductor kernel moves: its own estimate (`kernel_num_gb`, with Inductor's `profile_bandwidth`), else
    the sizes of the tensors its launch took (inputs and outputs, each once)."""
    args = launch["args"]
    if args.get("kernel_num_gb"):
        return args["kernel_num_gb"] * 1e9
    total = 0
    for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", []), strict=True):
        if not dims:  # scalars (0-d tensors: negligible)
            continue
        if dtype not in _DTYPE_BYTES:
            return None
        total += math.prod(dims) * _DTYPE_BYTES[dtype]
    return float(total) if total else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals sorted by start."""
    total, reach = 0.0, -math.inf
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _enclosing_ops(host: dict, call: dict) -> list[dict]:
    """The host ops on `call`'s thread whose range holds it, outermost first (`host_ops_by_thread`)."""
    ops = host.get((call["pid"], call["tid"]), [])
    return [event for event, _ in ops if event["ts"] <= call["ts"] <= event["ts"] + event["dur"]]


def markdown_table(step: dict, result: dict) -> list[str]:
    """One step's breakdown as a markdown table (`result`: the breakdown holding it)."""
    lost = step["launches_without_device_event"]
    lines = [
        f"{step['name']} on {result['device_name']}: device span {step['span_ms']:.1f} ms (host {step['host_ms']:.1f} "
        f"ms), kernels {step['kernel_ms']:.1f} ms in {step['launches']} launches, idle {step['idle_ms']:.1f} ms; "
        f"{result['device_ms_launched_outside_steps']:.1f} ms of kernels launched outside the step left out"
        + (f"; {lost} launch(es) whose kernels the trace lacks (it stopped before they ran)" if lost else ""),
        "",
        "| class | ms/step | launches | % of span | achieved | bound | % of bound | largest kernel |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cls in CLASSES:
        c = step["classes"][cls]
        if not c["launches"]:
            continue
        achieved, bound = "-", "-"
        if c["tflop_per_s"] is not None:
            achieved = f"{c['tflop_per_s']:.0f} TFLOP/s"
            achieved += f" ({c['flop_known_pct']:.0f}% of time)" if c["flop_known_pct"] < 99.5 else ""
        elif c["gb_per_s"] is not None:
            achieved = f"{c['gb_per_s']:.0f} GB/s"
            achieved += f" ({c['bytes_known_pct']:.0f}% of time)" if c["bytes_known_pct"] < 99.5 else ""
        if c["bound"]:
            bound = f"{c['bound']['tflop_per_s']:.0f} TFLOP/s" if c["bound"]["kind"] == "compute" else ""
            bound = bound or f"{c['bound']['gb_per_s']:.0f} GB/s"
        pct_of_bound = "-" if c["pct_of_bound"] is None else f"{c['pct_of_bound']:.0f}%"
        largest = c["top"][0]["name"][:60].replace("|", "\\|")
        lines.append(
            f"| {cls} | {c['ms']:.1f} | {c['launches']} | {c['pct_of_span']:.1f}% | {achieved} | {bound} | "
            f"{pct_of_bound} | `{largest}` |"
        )
    lines += [
        f"| idle | {step['idle_ms']:.1f} | - | {step['idle_pct_of_span']:.1f}% | - | - | - | - |",
        f"| kernels (streams added) | {step['kernel_ms']:.1f} | {step['launches']} | "
        f"{100.0 * step['kernel_ms'] / step['span_ms'] if step['span_ms'] else 0.0:.1f}% | - | - | - | - |",
    ]
    waits = step.get("host_waits", [])  # absent from breakdowns made before the waits were recorded
    if waits:
        lines += ["", f"Host waits for the device: {step['host_wait_ms']:.1f} ms of the step's host time:"]
    for wait in waits:
        where = f" in `{wait['op'][:60]}`" if wait["op"] else ""
        dims = f" {wait['op_input_dims']}" if wait["op_input_dims"] else ""
        lines.append(f"- {wait['ms']:.2f} ms in `{wait['call']}`{where}{dims}")
    gaps = step.get("idle_gaps", [])  # absent from breakdowns made before the gaps were recorded
    if gaps:
        lines += ["", "Longest idle gaps:"]
    for gap in gaps:
        lag = gap["launched_ms_after_gap_start"]
        when = "launch not in the trace" if lag is None else f"launched {lag:+.2f} ms from the gap's start"
        inside = f" in `{gap['launched_inside'][:60]}`" if gap["launched_inside"] else ""
        busy = ", ".join(f"`{b['op'][:60]}` {b['ms']:.2f} ms" for b in gap["host_during_gap"])
        lines.append(
            f"- {gap['ms']:.2f} ms before `{gap['before_kernel'][:60]}` ({when}{inside})"
            + (f"; host meanwhile: {busy}" if busy else "")
        )
    return lines


def read_gpu_trace(path: Path, script: str) -> dict:
    """The chrome trace at `path`; exits with one line where it cannot be read or holds no GPU work (a CPU run's
    trace: `script` breaks down device time, and a table of zeros would read as a measurement)."""
    try:
        trace = json.loads(path.read_text())
        events = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.exit(f"error: {path} is not a readable chrome trace ({type(err).__name__}: {err}); pass rank<R>_trace.json")
    if not any(event.get("cat") in DEVICE_EVENTS for event in events):
        sys.exit(
            f"error: {path} holds no GPU (CUDA) kernel, a CPU run's trace: {script} needs a GPU (CUDA) trace; profile "
            "a training run on a GPU (--profiling.enable_profiling)"
        )
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a chrome trace (rank<R>_trace.json)")
    parser.add_argument("--device-name", help="the device the trace ran on (default: the trace's deviceProperties)")
    parser.add_argument("--json", type=Path, help="also write the breakdown here")
    parser.add_argument("--add-to", type=Path, help="an e2e result JSON to store the breakdown in (profile_breakdown)")
    args = parser.parse_args()
    trace = read_gpu_trace(args.trace, "trace_breakdown.py")
    result = {"trace": str(args.trace), **breakdown(trace, args.device_name)}
    if not any(step["launches"] for step in result["steps"]):
        sys.exit(
            f"error: {args.trace} records GPU kernels but none launched inside a ProfilerStep; profile with the "
            "trainer's --profiling.enable_profiling, which records whole steps"
        )
    for step in result["steps"]:
        print("\n".join(markdown_table(step, result)) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.add_to:
        run = json.loads(args.add_to.read_text())
        args.add_to.write_text(json.dumps({**run, "profile_breakdown": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
