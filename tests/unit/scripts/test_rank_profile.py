"""`scripts/bench/rank_profile.py`: each rank's step cut into disjoint compute / exposed communication / waiting /
idle time, compute hiding the communication under it, and the summary across ranks."""

import json

import pytest

from scripts.bench.rank_profile import markdown_table, rank_profile, read_traces, segment_class, step_attribution
from tests.unit.tools._trace import device_event, host_event, launch_event

GROUPED = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<>>>"
NOTIFY = "void deep_ep::intranode::notify_dispatch<2>(int const*, int*, int, int const*, int*, int)"
DISPATCH = "void deep_ep::intranode::dispatch<2, 768, 8192>(int4*, float*, int*, long*, float*, int*)"
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def test_kernels_fall_into_their_segment_classes():
    assert segment_class(GROUPED) == "compute"
    assert segment_class("triton_poi_fused_add_0") == "compute"
    assert segment_class(NOTIFY) == "exchange_wait"
    assert segment_class("void deep_ep::intranode::cached_notify_combine<2>(void**, int*, int, int)") == (
        "exchange_wait"
    )
    assert segment_class(DISPATCH) == "exchange"
    assert segment_class("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "exchange"
    assert segment_class(ALL_GATHER) == "fsdp"
    assert segment_class("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)") == "fsdp"
    assert segment_class(ALL_REDUCE) == "other_collective"


def _event(name, ts, dur, stream=7):
    return {"name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_compute_hides_what_runs_under_it_and_the_rest_is_exposed_or_idle():
    events = [
        _event(GROUPED, 0, 100),  # compute 0..100
        _event(ALL_GATHER, 50, 100, stream=20),  # 50..100 hidden, 100..150 exposed
        _event(NOTIFY, 160, 30, stream=30),  # exposed wait 160..190 (idle 150..160)
        _event(DISPATCH, 190, 20, stream=30),  # exposed exchange
        _event("triton_poi_fused_add_0", 205, 25),  # compute 205..230 hides the dispatch's last 5
        _event(ALL_REDUCE, 240, 10, stream=20),  # idle 230..240, exposed 240..250
    ]
    a = step_attribution(events)
    assert a["span_ms"] == pytest.approx(0.25)
    assert a["exposed_ms"] == pytest.approx(
        {"compute": 0.125, "exchange": 0.015, "exchange_wait": 0.03, "fsdp": 0.05, "other_collective": 0.01}
    )
    assert a["idle_ms"] == pytest.approx(0.02)
    assert sum(a["exposed_ms"].values()) + a["idle_ms"] == pytest.approx(a["span_ms"])
    assert a["hidden_ms"] == pytest.approx(
        {"exchange": 0.005, "exchange_wait": 0.0, "fsdp": 0.05, "other_collective": 0}
    )
    assert a["grouped_gemm_ms"] == pytest.approx(0.1)
    assert a["deepep_notify_launches"] == 1


def _rank_trace(experts_us: int, wait_us: int) -> dict:
    """One profiled step: the experts' GEMM, then a notify kernel that waits `wait_us`."""
    return {
        "traceEvents": [
            host_event("ProfilerStep#12", 0, 50, cat="user_annotation"),
            launch_event("cuLaunchKernel", 10, correlation=1, cat="cuda_driver"),
            device_event(GROUPED, 7, 100, experts_us, correlation=1),
            launch_event("cudaLaunchKernel", 20, correlation=2),
            device_event(NOTIFY, 30, 100 + experts_us, wait_us, correlation=2),
        ]
    }


def test_ranks_summary_names_the_straggler_and_the_waiting(tmp_path):
    # rank 1 received more tokens: its experts run 300 us longer, and rank 0 waits that long at the next barrier
    for rank, (experts, wait) in enumerate([(700, 310), (1000, 10)]):
        (tmp_path / f"rank{rank}_trace.json").write_text(json.dumps(_rank_trace(experts, wait)))
    (tmp_path / "rank0_summary.json").write_text("{}")  # other files of the folder are ignored
    profile = rank_profile(read_traces(tmp_path))

    assert set(profile["ranks"]) == {"0", "1"}
    assert profile["ranks"]["0"]["exposed_ms"]["exchange_wait"] == pytest.approx(0.31)
    assert profile["ranks"]["1"]["exposed_ms"]["compute"] == pytest.approx(1.0)
    summary = profile["summary"]
    assert summary["compute_ms_max_minus_min"] == pytest.approx(0.3)
    assert summary["grouped_gemm_ms_max_over_mean"] == pytest.approx(1.0 / 0.85)
    assert summary["exposed_wait_ms_mean"] == pytest.approx(0.16)
    assert summary["span_ms_max"] == pytest.approx(1.01)
    table = markdown_table(profile)
    assert len(table) == 4 and table[2].startswith("| 0 | 1.0 | 0.7 |")


def test_a_step_without_device_work_attributes_nothing():
    # a CPU run's trace: host ops only
    a = step_attribution([])
    assert a["span_ms"] == a["idle_ms"] == a["grouped_gemm_ms"] == 0.0
    assert set(a["exposed_ms"]) == {"compute", "exchange", "exchange_wait", "fsdp", "other_collective"}


def test_a_cpu_run_s_traces_or_none_are_one_line_instead_of_a_table_of_zeros(tmp_path, monkeypatch, capsys):
    import sys

    from scripts.bench import rank_profile as script

    monkeypatch.setattr(sys, "argv", ["rank_profile.py", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"holds no rank<R>_trace.json; pass a profiled iteration's folder"):
        script.main()
    cpu = {"deviceProperties": [], "traceEvents": [host_event("ProfilerStep#4", 0, 50, cat="user_annotation")]}
    (tmp_path / "rank0_trace.json").write_text(json.dumps(cpu))
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert "holds no GPU (CUDA) kernel, a CPU run's trace: rank_profile.py needs a GPU (CUDA) trace" in str(exit_.value)
    assert capsys.readouterr().out == ""
