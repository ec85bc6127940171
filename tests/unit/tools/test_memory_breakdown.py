"""scripts/bench/memory_breakdown.py on a hand-made allocator snapshot (real ones need a GPU)."""

import pytest

from scripts.bench.memory_breakdown import GIB, analyse, holder

OURS = [
    {"filename": "/x/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"},
    {"filename": "/repo/torchtitan/kernels/permute.py", "line": 42, "name": "permute_tokens"},
]
TORCH_ONLY = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 7, "name": "step"}]


def _event(action, addr, size, stream=0, frames=None):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames or []}


def _snapshot():
    # Before the window: a 4 GiB state block (alive at the end) and a 1 GiB block freed inside the window.
    # In the window: a 2 GiB side-stream segment grows; 3 GiB (ours) and 1 GiB (torch) are allocated, the
    # 1 GiB old block freed, then the 3 GiB freed: the peak is 4 + 1 + 3 + 1 = 9 GiB at the fourth event.
    trace = [
        _event("segment_map", 0x900, 2 * GIB, stream=7),
        _event("alloc", 0x200, 3 * GIB, frames=OURS),
        _event("alloc", 0x300, 1 * GIB, stream=7, frames=TORCH_ONLY),
        _event("free_completed", 0x100, 1 * GIB),
        _event("free_completed", 0x200, 3 * GIB),
    ]
    segments = [
        {
            "device": 0,
            "stream": 0,
            "total_size": 10 * GIB,
            "blocks": [
                {"address": 0x000, "size": 4 * GIB, "state": "active_allocated", "frames": TORCH_ONLY},
                {"address": 0x500, "size": 6 * GIB, "state": "inactive"},
            ],
        },
        {
            "device": 0,
            "stream": 7,
            "total_size": 2 * GIB,
            "blocks": [{"address": 0x300, "size": 1 * GIB, "state": "active_allocated", "frames": TORCH_ONLY}],
        },
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_peak_and_its_holders():
    summary = analyse(_snapshot())
    assert summary["peak_allocated_gib"] == pytest.approx(9.0)
    assert summary["peak_event_index"] == 2
    assert summary["allocated_at_end_gib"] == pytest.approx(5.0)
    holders = {row["holder"]: row["gib"] for row in summary["holders_at_peak"]}
    assert holders["torchtitan/kernels/permute.py:42 permute_tokens"] == pytest.approx(3.0)
    assert holders["/x/site-packages/torch/optim/adamw.py:7 step"] == pytest.approx(5.0)
    assert holders["unknown (allocated before the trace window)"] == pytest.approx(1.0)


def test_reserved_per_stream():
    summary = analyse(_snapshot())
    assert summary["reserved_peak_by_stream_gib"] == {"0": pytest.approx(10.0), "7": pytest.approx(2.0)}
    assert summary["reserved_peak_gib"] == pytest.approx(12.0)
    assert summary["allocations_by_stream"]["7"] == [
        {"holder": "/x/site-packages/torch/optim/adamw.py:7 step", "gib": pytest.approx(1.0)}
    ]


def test_holder_prefers_our_innermost_frame():
    assert holder(OURS).startswith("torchtitan/kernels/permute.py:42")
    assert holder(TORCH_ONLY).startswith("/x/site-packages/torch/optim/adamw.py")
    assert holder(None).startswith("unknown")
    fsdp = [
        {
            "filename": "/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
            "line": 9,
            "name": "foreach_all_gather",
        },
        *OURS,
    ]
    assert holder(fsdp) == "torchtitan/kernels/permute.py:42 permute_tokens [FSDP foreach_all_gather]"
