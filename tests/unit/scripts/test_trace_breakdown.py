"""`scripts/bench/trace_breakdown.py`: a step's kernels (those launched inside it, however late they ran) by class,
with FLOPs from the launching ops, bytes from copies and Inductor's launches, idle time over several streams."""

import json
import sys

import pytest

from scripts.bench import trace_breakdown
from scripts.bench.trace_breakdown import breakdown, classify, markdown_table
from tests.unit.tools._trace import (
    ATTENTION_FLOP,
    GROUPED_MM_FLOP,
    MEMCPY_BYTES,
    MM_FLOP,
    TO_COPY_BYTES,
    device_event,
    host_event,
    launch_event,
    synthetic_trace,
)

H200_TFLOPS, H200_GBPS = 989.0, 4800.0


def test_steps_classes_idle_and_rates():
    result = breakdown(synthetic_trace())

    assert result["device_name"] == "NVIDIA H200"
    assert (result["peak_bf16_tflop_per_s"], result["hbm_gb_per_s"]) == (H200_TFLOPS, H200_GBPS)
    assert result["device_ms_launched_outside_steps"] == pytest.approx(0.15)
    first, second = result["steps"]
    span_us = 2020 - 1190
    assert first["span_ms"] == pytest.approx(span_us / 1e3)
    assert first["kernel_ms"] == pytest.approx(0.84)
    assert first["busy_ms"] == pytest.approx(0.64)  # 1190..1810 and 2000..2020; flash on stream 13 overlaps
    assert first["idle_ms"] == pytest.approx(0.19)
    assert first["overlap_ms"] == pytest.approx(0.2)
    assert first["idle_pct_of_span"] == pytest.approx(100 * 190 / span_us)
    assert first["launches"] == 6
    assert first["launches_without_device_event"] == 1

    classes = first["classes"]
    dense = classes["dense_gemm"]  # nvjet (the mm's FLOPs: its longest kernel) and splitKreduce (none)
    assert (dense["ms"], dense["launches"]) == (pytest.approx(0.21), 2)
    assert dense["tflop"] == pytest.approx(MM_FLOP / 1e12)
    assert dense["tflop_per_s"] == pytest.approx(MM_FLOP / 200e-6 / 1e12)
    assert dense["flop_known_pct"] == pytest.approx(100 * 200 / 210)
    assert dense["bound"] == {"kind": "compute", "tflop_per_s": H200_TFLOPS}
    assert dense["pct_of_bound"] == pytest.approx(100 * MM_FLOP / 200e-6 / 1e12 / H200_TFLOPS)
    assert dense["pct_of_span"] == pytest.approx(100 * 210 / span_us)
    grouped = classes["grouped_gemm"]  # launched from the autograd thread; the main thread's mm there is not its op
    assert grouped["tflop_per_s"] == pytest.approx(GROUPED_MM_FLOP / 400e-6 / 1e12)
    assert grouped["flop_known_pct"] == pytest.approx(100.0)
    attention = classes["attention_fwd"]
    assert (attention["ms"], attention["launches"]) == (pytest.approx(0.2), 1)
    assert attention["tflop_per_s"] == pytest.approx(ATTENTION_FLOP / 200e-6 / 1e12)
    casts = classes["casts_copies"]  # the Inductor cast and the memcpy
    assert (casts["ms"], casts["launches"]) == (pytest.approx(0.03), 2)
    assert casts["gb"] == pytest.approx((TO_COPY_BYTES + MEMCPY_BYTES) / 1e9)
    assert casts["gb_per_s"] == pytest.approx((TO_COPY_BYTES + MEMCPY_BYTES) / 30e-6 / 1e9)
    assert casts["bound"] == {"kind": "memory", "gb_per_s": H200_GBPS}
    assert casts["pct_of_bound"] == pytest.approx(100 * (TO_COPY_BYTES + MEMCPY_BYTES) / 30e-6 / 1e9 / H200_GBPS)
    assert casts["tflop_per_s"] is None
    assert sum(c["ms"] for c in classes.values()) == pytest.approx(first["kernel_ms"])
    assert [cls for cls, c in classes.items() if c["launches"]] == [
        "grouped_gemm",
        "dense_gemm",
        "attention_fwd",
        "casts_copies",
    ]

    assert (second["span_ms"], second["idle_ms"], second["overlap_ms"]) == (
        pytest.approx(0.3),
        pytest.approx(0.0),
        pytest.approx(0.1),
    )
    optimizer, communication = second["classes"]["optimizer"], second["classes"]["communication"]
    assert (optimizer["ms"], optimizer["gb_per_s"], optimizer["pct_of_bound"]) == (pytest.approx(0.3), None, None)
    assert (communication["ms"], communication["bound"]) == (pytest.approx(0.1), None)


def test_idle_gap_of_a_kernel_queued_early_names_no_host_work():
    # Step 1's one gap (1810..2000): the memcpy after it was launched at 700, long before the device got there, so
    # the device waited for something else than the host.
    (gap,) = breakdown(synthetic_trace())["steps"][0]["idle_gaps"]
    assert gap["ms"] == pytest.approx(0.19)
    assert (gap["after_kernel"], gap["before_kernel"]) == (
        "triton_poi_fused__to_copy_0",
        "Memcpy DtoD (Device -> Device)",
    )
    assert gap["launched_ms_after_gap_start"] == pytest.approx(-1.11)
    assert gap["launched_inside"] is None and gap["host_during_gap"] == []


def test_idle_gaps_name_what_the_host_did_while_the_device_waited():
    """The stall a drained queue causes: after the step's first kernel the host loads a batch, then copies it in."""
    events = [
        host_event("ProfilerStep#1", 100, 900, cat="user_annotation"),
        launch_event("cudaLaunchKernel", 110, correlation=1),
        device_event("triton_poi_fused_add_0", 7, 120, 80, correlation=1),
        host_event("enumerate(DataLoader)#_StatefulSingleProcessDataLoaderIter.__next__", 210, 490),
        host_event("aten::index", 300, 50),  # inside the loader: not an outermost op
        host_event("aten::to", 702, 20),
        host_event("aten::copy_", 705, 15),
        launch_event("cudaMemcpyAsync", 710, correlation=2),
        device_event("Memcpy HtoD (Pageable -> Device)", 7, 715, 5, correlation=2, cat="gpu_memcpy", bytes=8),
        launch_event("cudaLaunchKernel", 730, correlation=3),
        device_event("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 7, 721, 100, correlation=3),
        launch_event("cudaLaunchKernel", 740, correlation=4),
        device_event("triton_poi_fused_mul_1", 7, 900, 10, correlation=4),
    ]
    trace = {"deviceProperties": [{"name": "NVIDIA H200"}], "traceEvents": events}
    step = breakdown(trace)["steps"][0]
    first, second, third = step["idle_gaps"]  # longest first
    assert first["ms"] == pytest.approx(0.515)  # 200..715
    assert first["before_kernel"] == "Memcpy HtoD (Pageable -> Device)"
    assert first["launched_ms_after_gap_start"] == pytest.approx(0.51)  # the host launched it late
    assert first["launched_inside"] == "aten::copy_"
    assert [(b["op"], round(b["ms"], 3)) for b in first["host_during_gap"]] == [
        ("enumerate(DataLoader)#_StatefulSingleProcessDataLoaderIter.__next__", 0.49),
        ("aten::to", 0.008),
    ]
    assert (second["ms"], third["ms"]) == (pytest.approx(0.079), pytest.approx(0.001))  # 821..900, 720..721
    assert step["idle_ms"] == pytest.approx(0.515 + 0.079 + 0.001)
    table = "\n".join(markdown_table(step, breakdown(trace)))
    assert "- 0.52 ms before `Memcpy HtoD (Pageable -> Device)` (launched +0.51 ms from the gap's start in " in table
    assert "host meanwhile: `enumerate(DataLoader)#_StatefulSingleProcessDataLoaderIter._` 0.49 ms" in table


def test_host_waits_name_the_blocking_call_and_the_op_it_ran_in():
    """The wait that emptied every step's queue (one H200, 332b892): the batch's copy from pageable memory, an
    `aten::to` of (4, 4096) token ids whose cudaStreamSynchronize held the host until the queued step had run."""
    events = [
        host_event("ProfilerStep#1", 100, 900, cat="user_annotation"),
        host_event("aten::to", 110, 700, **{"Input Dims": [[4, 4096], [], []]}),
        host_event("aten::copy_", 112, 695),
        launch_event("cudaMemcpyAsync", 115, correlation=1),
        launch_event("cudaStreamSynchronize", 120, correlation=2, dur=680),
        device_event("Memcpy HtoD (Pageable -> Device)", 7, 790, 5, correlation=1, cat="gpu_memcpy", bytes=8),
        launch_event("cudaDeviceSynchronize", 850, correlation=3, dur=40),  # outside any op
        launch_event("cudaLaunchKernel", 900, correlation=4),
        device_event("triton_poi_fused_add_0", 7, 905, 50, correlation=4),
    ]
    trace = {"deviceProperties": [{"name": "NVIDIA H200"}], "traceEvents": events}
    result = breakdown(trace)
    step = result["steps"][0]
    assert step["host_wait_ms"] == pytest.approx(0.72)
    batch_copy, outside_any_op = step["host_waits"]  # longest first
    assert batch_copy == {
        "ms": pytest.approx(0.68),
        "call": "cudaStreamSynchronize",
        "op": "aten::to",
        "op_input_dims": [[4, 4096], [], []],
    }
    assert (outside_any_op["ms"], outside_any_op["call"]) == (pytest.approx(0.04), "cudaDeviceSynchronize")
    assert outside_any_op["op"] is None and outside_any_op["op_input_dims"] is None
    table = "\n".join(markdown_table(step, result))
    assert "Host waits for the device: 0.7 ms of the step's host time:" in table
    assert "- 0.68 ms in `cudaStreamSynchronize` in `aten::to` [[4, 4096], [], []]" in table


@pytest.mark.parametrize(
    "kernel, cls",
    [
        ("void cutlass::device_kernel<...GroupProblemShape<...>, ...MainloopSm90ArrayTmaGmma>", "grouped_gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "dense_gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense_gemm"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4>>", "attention_fwd"),
        ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention_bwd"),
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention_bwd"),
        ("_adamw_kernel", "optimizer"),
        ("_sum_of_squares_kernel", "optimizer"),
        ("triton_poi_fused__grouped_mm__to_copy_transpose_0", "casts_copies"),  # a weight cast for the GEMM it names
        ("triton_poi_fused__to_copy_2", "casts_copies"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>", "casts_copies"),
        ("_tile_column_cast_kernel", "casts_copies"),
        ("triton_poi_fused_index_select_mul_4", "moe_glue"),
        ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>", "moe_glue"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", "norms_elementwise"),
        ("void at::native::elementwise_kernel<128, 2, gpu_kernel_impl_nocast<MulFunctor<float>>>", "norms_elementwise"),
        ("void deep_ep::intranode::dispatch<8, 768, 8192>", "communication"),
        ("ncclDevKernel_SendRecv", "communication"),
        ("embedding_backward_feature_kernel", "other"),
    ],
)  # fmt: skip
def test_kernel_classes(kernel, cls):
    assert classify(kernel) == cls


def test_cli_prints_the_table_and_adds_the_breakdown_to_a_result(tmp_path, monkeypatch, capsys):
    trace, run = tmp_path / "rank0_trace.json", tmp_path / "e2e_run.json"
    trace.write_text(json.dumps(synthetic_trace()))
    run.write_text(json.dumps({"name": "run", "tokens_per_sec_per_gpu": 1.0}))
    monkeypatch.setattr(sys, "argv", ["trace_breakdown.py", str(trace), "--add-to", str(run)])

    trace_breakdown.main()

    table = capsys.readouterr().out
    assert "| grouped_gemm | 0.4 | 1 | 48.2% | 1 TFLOP/s | 989 TFLOP/s | 0% |" in table
    assert "| casts_copies | 0.0 | 2 | 3.6% | 233 GB/s | 4800 GB/s | 5% |" in table
    assert "| idle | 0.2 | - | 22.9% |" in table
    stored = json.loads(run.read_text())
    assert stored["name"] == "run" and stored["profile_breakdown"]["trace"] == str(trace)
    assert markdown_table(stored["profile_breakdown"]["steps"][0], stored["profile_breakdown"])[4].startswith(
        "| grouped_gemm |"
    )


def cpu_trace() -> dict:
    """What a CPU run's trace holds: host ops and steps, no device events, no device properties."""
    device = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver")
    events = [event for event in synthetic_trace()["traceEvents"] if event.get("cat") not in device]
    return {"deviceProperties": [], "traceEvents": events}


@pytest.mark.parametrize(
    "trace, message",
    [
        (cpu_trace(), "holds no GPU (CUDA) kernel, a CPU run's trace: trace_breakdown.py needs a GPU (CUDA) trace; "),
        ({**synthetic_trace(), "traceEvents": [e for e in synthetic_trace()["traceEvents"]
                                               if not e["name"].startswith("ProfilerStep#")]},
         "records GPU kernels but none launched inside a ProfilerStep"),
        ("{not json", "is not a readable chrome trace (JSONDecodeError: "),
    ],
    ids=["cpu-run", "no-steps", "not-json"],
)  # fmt: skip
def test_cli_on_a_trace_it_cannot_break_down_says_why_in_one_line(trace, message, tmp_path, monkeypatch, capsys):
    path = tmp_path / "rank0_trace.json"
    path.write_text(trace if isinstance(trace, str) else json.dumps(trace))
    monkeypatch.setattr(sys, "argv", ["trace_breakdown.py", str(path)])
    with pytest.raises(SystemExit) as exit_:
        trace_breakdown.main()
    assert str(exit_.value).startswith(f"error: {path} ") and message in str(exit_.value), exit_.value
    assert "\n" not in str(exit_.value) and capsys.readouterr().out == ""
