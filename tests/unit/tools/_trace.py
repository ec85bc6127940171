"""A hand-written chrome trace, in the format `export_chrome_trace` writes, of two profiled steps on an H200.

Times in microseconds. Host threads: 1 (main), 2 (autograd). Streams: 7 and 13 (kernels), 20 (NCCL).

ProfilerStep#1, host 100..1000:
    aten::linear > aten::mm [[64, 128], [128, 256]]       launches nvjet (1200..1400) and splitKreduce (1190..1200)
    aten::_grouped_mm [[1024, 256], [8, 256, 512]]        autograd thread; launches the grouped GEMM (1400..1800)
    aten::mm on the main thread inside the grouped GEMM's host range, launching nothing (must not take its FLOPs)
    triton_poi_fused__to_copy_0, 6e6 bytes of buffers      launches itself (1800..1810)
    aten::_scaled_dot_product_flash_attention, causal     launches flash_fwd on stream 13 (1500..1700), overlapping
    cudaMemcpyAsync                                        Memcpy DtoD of 1e6 bytes (2000..2020)
    cudaStreamSynchronize 150 us, deepep::dispatch 40 us, and a launch whose kernel is not in the trace
    All of it runs after the step's host range ended. Span 1190..2020 = 830 us, busy 620 + 20, idle 190.
ProfilerStep#2, host 1000.5..2000:
    _adamw_kernel (2100..2400), ncclDevKernel_AllReduce on stream 20 (2150..2250)
Outside every step: a kernel launched at 50 (1000..1100) and one whose launch is not in the trace (1100..1150).
"""

MM_FLOP = 2 * 64 * 128 * 256
GROUPED_MM_FLOP = 2 * 1024 * 256 * 512
ATTENTION_FLOP = 2 * (2 * 2 * 128 * 128 * 64) // 2  # QK^T and PV of (1, 2 heads, 128, 64), halved: causal
TO_COPY_BYTES = 1_000_000 * 4 + 1_000_000 * 2
MEMCPY_BYTES = 1_000_000


def host_event(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def launch_event(name, ts, correlation, tid=1, dur=5, cat="cuda_runtime"):
    return host_event(name, ts, dur, tid=tid, cat=cat, correlation=correlation, cbid=211)


def device_event(name, stream, ts, dur, correlation, cat="kernel", **args):
    return {
        "ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
        "args": {"device": 0, "stream": stream, "correlation": correlation, **args},
    }  # fmt: skip


def _shapes(dims, types=None, concrete=None):
    types = types or ["c10::BFloat16"] * len(dims)
    return {"Input Dims": dims, "Input type": types, "Concrete Inputs": concrete or [""] * len(dims)}


def synthetic_trace() -> dict:
    grouped = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<>>>"
    qkv = [[1, 2, 128, 64]] * 3 + [[]] * 4
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        launch_event("cudaLaunchKernel", 50, correlation=1),
        device_event("nvjet_tst_before_the_window", 7, 1000, 100, correlation=1),
        device_event("triton_poi_fused_add_0", 7, 1100, 50, correlation=99),
        host_event("ProfilerStep#1", 100, 900, cat="user_annotation"),
        host_event("aten::linear", 190, 120),
        host_event("aten::mm", 200, 100, **_shapes([[64, 128], [128, 256]])),
        launch_event("cudaLaunchKernel", 250, correlation=2),
        device_event("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 7, 1200, 200, correlation=2),
        launch_event("cudaLaunchKernel", 270, correlation=9),
        device_event("void cublasLt::splitKreduce_kernel<float>", 7, 1190, 10, correlation=9),
        host_event("aten::_grouped_mm", 400, 100, tid=2, **_shapes([[1024, 256], [8, 256, 512], [8], [], []])),
        launch_event("cuLaunchKernel", 420, correlation=3, tid=2, cat="cuda_driver"),
        device_event(grouped, 7, 1400, 400, correlation=3),
        host_event("aten::mm", 410, 100, **_shapes([[4096, 4096], [4096, 4096]])),
        host_event(
            "triton_poi_fused__to_copy_0",
            520,
            20,
            kernel_backend="triton",
            **_shapes([[1_000_000], [1_000_000], []], ["float", "c10::BFloat16", "Scalar"]),
        ),
        launch_event("cuLaunchKernel", 525, correlation=4, cat="cuda_driver"),
        device_event("triton_poi_fused__to_copy_0", 7, 1800, 10, correlation=4),
        host_event(
            "aten::_scaled_dot_product_flash_attention",
            590,
            30,
            **_shapes(qkv, concrete=["", "", "", "0.", "True", "False", ""]),
        ),
        launch_event("cudaLaunchKernel", 600, correlation=5),
        device_event("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", 13, 1500, 200, correlation=5),
        launch_event("cudaMemcpyAsync", 700, correlation=6),
        device_event(
            "Memcpy DtoD (Device -> Device)", 7, 2000, 20, correlation=6, cat="gpu_memcpy", bytes=MEMCPY_BYTES
        ),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 6, "pid": 1, "tid": 1, "ts": 700},
        host_event("cudaStreamSynchronize", 800, 150, cat="cuda_runtime", correlation=7),
        host_event("deepep::dispatch", 955, 40),
        launch_event("cudaLaunchKernel", 996, correlation=8),
        host_event("ProfilerStep#2", 1000.5, 999.5, cat="user_annotation"),
        launch_event("cudaLaunchKernel", 1500, correlation=10),
        device_event("_adamw_kernel", 7, 2100, 300, correlation=10),
        launch_event("cudaLaunchKernel", 1600, correlation=11),
        device_event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 20, 2150, 100, correlation=11),
        host_event("ProfilerStep#2", 2100, 1, tid=0, cat="gpu_user_annotation"),  # the GPU row's copy: not a host step
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], "traceEvents": events}
