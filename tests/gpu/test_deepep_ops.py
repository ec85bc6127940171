"""DeepEP CUDA kernels (`deep_ep`) checked against the CPU gloo reference, their backward, and a compiled MoE block.

One command, one node with >= 2 GPUs (the test spawns one process per GPU itself):

    OUT=/tmp/deepep python -m pytest -q tests/gpu/test_deepep_ops.py

DEEPEP_TEST_WORLD_SIZE picks the number of GPUs: 2, 4 or 8 (default: the largest that fits). With OUT set, rank 0 writes
$OUT/deepep_gpu_summary.json (per-check status, errors, timings, versions). Skips cleanly without CUDA, without
deep_ep, or with fewer than 2 GPUs. On one GPU the op checks still run with two ranks sharing it (start the CUDA MPS
daemon first, `nvidia-cuda-mps-control -d`, so the two ranks' kernels run at the same time).
"""

import datetime
import json
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP (pip install sgl-deep-ep, or build from source)")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from tests.unit.models.moe._expert_rows import expert_of_padded_row  # noqa: E402
from torchtitan.distributed.deepep import get_or_create_buffer  # noqa: E402
from torchtitan.distributed.expert_parallel.deepep_dispatcher import DeepEPExpertParallel, DeepEPTokenDispatcher  # noqa: E402,E501
from torchtitan.distributed.expert_parallel.dispatcher import run_on_expert_rows  # noqa: E402
from torchtitan.distributed.expert_parallel.styles import ExpertParallel  # noqa: E402
from torchtitan.distributed.group_buffers import release_group_buffers  # noqa: E402
from torchtitan.distributed.utils import destroy_process_groups  # noqa: E402
from torchtitan.kernels.float8 import dequantize_blockwise, quantize_blockwise  # noqa: E402
from torchtitan.models.moe import MoE, MoEArgs  # noqa: E402
from torchtitan.models.moe.deepep_moe import DeepEPMoE  # noqa: E402

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

HIDDEN, NUM_EXPERTS, TOP_K, NUM_SMS = 512, 16, 4, 24
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _routing(rank: int, num_tokens: int, hidden: int = HIDDEN, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K):
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen)
    topk_idx = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
    topk_idx[::5, -1] = -1  # masked choices
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, topk_idx, topk_weights


def _check_ops_match_cpu_reference(rank, world_size, cuda_group, cpu_group):
    x, topk_idx, topk_weights = _routing(rank, 96 + 37 * rank)  # uneven token counts
    x = x.bfloat16()
    cuda = torch.ops.deepep.dispatch(
        x.cuda(), topk_idx.cuda(), topk_weights.cuda(), NUM_EXPERTS, cuda_group.group_name, False, False
    )
    ref = torch.ops.deepep.dispatch(x, topk_idx, topk_weights, NUM_EXPERTS, cpu_group.group_name, False, False)
    names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert", "permuted_slots")
    for name, got, want in zip(names, cuda[:5], ref[:5], strict=True):
        assert got.is_cuda and torch.equal(got.cpu(), want), f"dispatch {name} differs from the CPU reference"

    back = (cuda[0].float() * (rank + 1)).bfloat16()
    combined, _ = torch.ops.deepep.combine(back, cuda[5], cuda_group.group_name, None)
    combined_ref, _ = torch.ops.deepep.combine(back.cpu(), ref[5], cpu_group.group_name, None)
    torch.testing.assert_close(combined.cpu(), combined_ref, **BF16_TOL)
    _, weights = torch.ops.deepep.combine(cuda[0], cuda[5], cuda_group.group_name, cuda[2])
    _, weights_ref = torch.ops.deepep.combine(ref[0], ref[5], cpu_group.group_name, ref[2])
    torch.testing.assert_close(weights.cpu(), weights_ref)
    again = torch.ops.deepep.cached_dispatch(x.cuda() * 2, cuda[5], cuda_group.group_name)
    assert torch.equal(again.cpu(), ref[0] * 2)


def _check_sync_free_dispatch_matches_cpu_reference(rank, world_size, cuda_group, cpu_group):
    """Worst-case sizes (DeepEP's num_worst_tokens): the received rows, counts and slots of the CPU reference, the
    padding rows' expert ids -1, and a combine that ignores the padding."""
    x, topk_idx, topk_weights = _routing(rank, 96)  # sync-free: the same token count on every rank
    x = x.bfloat16()
    cuda = torch.ops.deepep.dispatch(
        x.cuda(), topk_idx.cuda(), topk_weights.cuda(), NUM_EXPERTS, cuda_group.group_name, True, False
    )
    ref = torch.ops.deepep.dispatch(x, topk_idx, topk_weights, NUM_EXPERTS, cpu_group.group_name, True, False)
    num_recv = int((ref[1] >= 0).any(1).sum())
    assert cuda[0].shape[0] == ref[0].shape[0] == 96 * world_size
    assert torch.equal(cuda[0][:num_recv].cpu(), ref[0][:num_recv]), "recv_x"
    assert torch.equal(cuda[1].cpu(), ref[1]), "recv_topk_idx, padding included"
    assert torch.equal(cuda[2][:num_recv].cpu(), ref[2][:num_recv]), "recv_topk_weights"
    assert torch.equal(cuda[3].cpu(), ref[3]), "num_recv_tokens_per_expert"
    assert torch.equal(cuda[4].cpu(), ref[4]), "permuted_slots"
    back = (cuda[0].float() * (rank + 1)).bfloat16()
    combined, _ = torch.ops.deepep.combine(back, cuda[5], cuda_group.group_name, None)
    combined_ref, _ = torch.ops.deepep.combine(back.cpu(), ref[5], cpu_group.group_name, None)
    torch.testing.assert_close(combined.cpu(), combined_ref, **BF16_TOL)


def _check_fp8_dispatch_matches_cpu_reference(rank, world_size, cuda_group, cpu_group):
    """DeepEP's FP8 dispatch ((x, x_scales) tuples, one scale per 128 channels): exactly the GPU's blockwise FP8
    round trip of what the bf16 dispatch receives (DeepEP moves the bytes and scales unchanged), and the CPU
    reference's layout and values within one bf16 step: CUDA divides the scales by 448 as a product with its
    reciprocal, so about half of them are one fp32 ulp off the CPU's, which moves ~1% of the bf16 outputs by one
    step (measured on H200, 2 ranks on one GPU)."""
    x, topk_idx, topk_weights = _routing(rank, 96 + 37 * rank)
    x = x.bfloat16()
    cuda = torch.ops.deepep.dispatch(
        x.cuda(), topk_idx.cuda(), topk_weights.cuda(), NUM_EXPERTS, cuda_group.group_name, False, True
    )
    ref = torch.ops.deepep.dispatch(x, topk_idx, topk_weights, NUM_EXPERTS, cpu_group.group_name, False, True)
    for name, got, want in zip(("idx", "weights", "counts", "slots"), cuda[1:5], ref[1:5], strict=True):
        assert torch.equal(got.cpu(), want), f"fp8 dispatch {name} differs from the CPU reference"
    assert cuda[0].dtype == torch.bfloat16
    bf16 = torch.ops.deepep.dispatch(
        x.cuda(), topk_idx.cuda(), topk_weights.cuda(), NUM_EXPERTS, cuda_group.group_name, False, False
    )
    round_trip = dequantize_blockwise(*quantize_blockwise(bf16[0])).to(torch.bfloat16)
    assert torch.equal(cuda[0], round_trip), "fp8 recv_x is not the FP8 round trip of the received tokens"
    assert not torch.equal(cuda[0], bf16[0])  # it did go through FP8
    torch.testing.assert_close(cuda[0].cpu(), ref[0], rtol=2**-7, atol=0)  # one bf16 step
    torch.testing.assert_close(cuda[0].float(), bf16[0].float(), rtol=0.07, atol=1e-2)


def _check_backward_matches_cpu_reference(rank, world_size, cuda_group, cpu_group):
    x, topk_idx, topk_weights = _routing(rank, 64 + 29 * rank)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    local_experts = NUM_EXPERTS // world_size

    def run(device, group):
        dispatcher = DeepEPTokenDispatcher(group.group_name, NUM_EXPERTS)
        xd = x.to(device).requires_grad_()
        wd = topk_weights.to(device).requires_grad_()
        tokens, state = dispatcher.dispatch(xd, topk_idx.to(device), wd)

        def experts(rows, group_ends):
            scale = 1.0 + rank * local_experts + expert_of_padded_row(group_ends, rows.shape[0])
            return torch.tanh(rows) * scale.unsqueeze(1)

        out = dispatcher.combine(run_on_expert_rows(tokens, experts, 8, xd.dtype), state)
        (out * upstream.to(device)).sum().backward()
        return out.cpu(), xd.grad.cpu(), wd.grad.cpu()

    # The CUDA wire is bf16 and the weight gradients are dot products over the hidden dim, which cancel for some
    # entries: compare by relative norm error (bf16 operands land between 1e-3 and 1e-2), not element-wise.
    for name, got, want in zip(
        ("out", "x.grad", "weights.grad"), run("cuda", cuda_group), run("cpu", cpu_group), strict=True
    ):
        rel_err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel_err < 1e-2, f"{name}: relative error {rel_err:.2e} vs the CPU reference"


def _moe_args() -> MoEArgs:
    return MoEArgs(num_experts=NUM_EXPERTS, num_shared_experts=1, top_k=TOP_K, score_func="sigmoid", route_norm=True)


def _build(cls, mesh, style):
    torch.manual_seed(0)
    moe = cls(_moe_args(), HIDDEN, 256)
    moe.init_weights(init_std=0.02)
    moe.cuda()
    parallelize_module(moe, mesh, style)
    return moe


def _forward_backward(moe, x, call=None):
    x = x.clone().requires_grad_()
    out = (moe if call is None else call)(x)
    out.float().pow(2).sum().backward()
    grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


def _check_moe_block_eager_compiled_and_side_stream(rank, world_size, cuda_group, cpu_group):
    torch._dynamo.config.capture_scalar_outputs = True
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    x = torch.randn(2, 48 + 16 * rank, HIDDEN, generator=torch.Generator().manual_seed(rank)).cuda()

    reference = _forward_backward(_build(MoE, mesh, ExpertParallel()), x)
    moe = _build(DeepEPMoE, mesh, DeepEPExpertParallel(num_sms=NUM_SMS))
    side_stream = moe.side_stream = torch.cuda.Stream()
    eager = _forward_backward(moe, x)
    moe.zero_grad()
    moe.side_stream = None
    inline = _forward_backward(moe, x)
    moe.zero_grad()
    moe.side_stream = side_stream
    compiled = _forward_backward(moe, x, call=torch.compile(moe, fullgraph=True))

    for label, got, tol in (
        ("deepep vs standard EP", eager, BF16_TOL),
        ("compiled vs eager", compiled, BF16_TOL),
        ("side stream vs inline", inline, dict(rtol=0, atol=0)),
    ):
        want = reference if label.endswith("standard EP") else eager
        torch.testing.assert_close(got[0], want[0], **tol, msg=label)
        torch.testing.assert_close(got[1], want[1], **tol, msg=label)
        for name, grad in got[2].items():
            torch.testing.assert_close(grad, want[2][name], **tol, msg=f"{label}: {name}")


def _check_sync_free_moe_matches_synced_without_host_syncs(rank, world_size, cuda_group, cpu_group):
    """The sync-free DeepEPMoE trains like the synced one (eager and compiled), and its forward and backward make no
    synchronizing CUDA call (torch's sync debug mode raises on one)."""
    torch._dynamo.config.capture_scalar_outputs = True
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    x = torch.randn(2, 64, HIDDEN, generator=torch.Generator().manual_seed(rank)).cuda()
    synced = _forward_backward(_build(DeepEPMoE, mesh, DeepEPExpertParallel(num_sms=NUM_SMS)), x)
    moe = _build(DeepEPMoE, mesh, DeepEPExpertParallel(num_sms=NUM_SMS, sync_free=True))
    eager = _forward_backward(moe, x)
    moe.zero_grad()
    compiled = _forward_backward(moe, x, call=torch.compile(moe, fullgraph=True))
    for label, got in (("sync-free eager", eager), ("sync-free compiled", compiled)):
        torch.testing.assert_close(got[0], synced[0], **BF16_TOL, msg=label)
        torch.testing.assert_close(got[1], synced[1], **BF16_TOL, msg=label)
        for name, grad in got[2].items():
            torch.testing.assert_close(grad, synced[2][name], **BF16_TOL, msg=f"{label}: {name}")
    moe.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x.clone().requires_grad_())
        out.float().pow(2).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _check_forward_only_memory_is_flat(rank, world_size, cuda_group, cpu_group):
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    moe = _build(DeepEPMoE, mesh, DeepEPExpertParallel(num_sms=NUM_SMS))
    x = torch.randn(2, 64, HIDDEN, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            moe(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(1000):
            moe(x)
    with torch.inference_mode():
        for _ in range(100):
            moe(x)
    torch.cuda.synchronize()
    # slack for frees the caching allocator defers until streams catch up; a leak grows by ~1000 handles
    after = torch.cuda.memory_allocated()
    assert after <= before + 2**20, f"forward-only passes leaked {after - before} bytes"


def _measure_dispatch_combine(rank, world_size, cuda_group, cpu_group):
    """Not a check: latency of dispatch + combine at a DeepSeek-like routing (for the summary)."""
    hidden, num_experts, top_k, num_tokens = 2048, 64, 8, 4096
    get_or_create_buffer(cuda_group, hidden, device_type="cuda", num_sms=NUM_SMS)  # grows the buffer
    x, topk_idx, topk_weights = _routing(rank, num_tokens, hidden, num_experts, top_k)
    x, topk_idx, topk_weights = x.bfloat16().cuda(), topk_idx.cuda(), topk_weights.cuda()
    timings = {}
    for phase in ("dispatch", "dispatch_sync_free", "dispatch_fp8", "combine"):
        times = []
        for step in range(12):
            torch.cuda.synchronize()
            dist.barrier(group=cpu_group)
            start = time.perf_counter()
            sync_free, fp8 = phase == "dispatch_sync_free", phase == "dispatch_fp8"
            out = torch.ops.deepep.dispatch(
                x, topk_idx, topk_weights, num_experts, cuda_group.group_name, sync_free, fp8
            )
            if phase == "combine":
                torch.cuda.synchronize()
                start = time.perf_counter()
                torch.ops.deepep.combine(out[0], out[5], cuda_group.group_name, None)
            torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - start)
        timings[f"{phase}_ms_median"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    timings.update(hidden=hidden, num_experts=num_experts, top_k=top_k, tokens_per_rank=num_tokens)
    return timings


_OP_CHECKS = (
    _check_ops_match_cpu_reference,
    _check_sync_free_dispatch_matches_cpu_reference,
    _check_fp8_dispatch_matches_cpu_reference,
    _check_backward_matches_cpu_reference,
)
_CHECKS = (
    *_OP_CHECKS,
    _check_moe_block_eager_compiled_and_side_stream,
    _check_sync_free_moe_matches_synced_without_host_syncs,
    _check_forward_only_memory_is_flat,
    _measure_dispatch_combine,
)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str | None, share_gpu: bool = False) -> None:
    """One rank. With `share_gpu` every rank runs on GPU 0 and only the op checks run: NCCL refuses two ranks on
    one GPU, but DeepEP's intranode buffer needs the group only to exchange IPC handles (gloo does)."""
    torch.cuda.set_device(0 if share_gpu else rank)
    dist.init_process_group(
        "gloo" if share_gpu else "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=5),
    )
    cpu_group = dist.new_group(backend="gloo")
    cuda_group = dist.group.WORLD
    checks = _OP_CHECKS if share_gpu else _CHECKS
    get_or_create_buffer(cuda_group, HIDDEN, device_type="cuda", num_sms=NUM_SMS)
    get_or_create_buffer(cpu_group, HIDDEN, device_type="cpu")

    results = []
    for check in checks:
        start = time.perf_counter()
        result = {"check": check.__name__.lstrip("_"), "status": "passed"}
        try:
            extra = check(rank, world_size, cuda_group, cpu_group)
            if extra:
                result["metrics"] = extra
        except Exception:
            result.update(status="failed", error=traceback.format_exc())
        torch.cuda.synchronize()
        dist.barrier(group=cpu_group)
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)

    per_rank: list = [None] * world_size
    dist.all_gather_object(per_rank, results, group=cpu_group)
    if rank == 0 and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        summary = {
            "world_size": world_size,
            "ranks_share_one_gpu": share_gpu,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "deep_ep": getattr(deep_ep, "__version__", "unknown"),
            "passed": all(r["status"] == "passed" for rank_results in per_rank for r in rank_results),
            "ranks": per_rank,
        }
        name = "deepep_gpu_summary_shared_gpu.json" if share_gpu else "deepep_gpu_summary.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(summary, f, indent=2)
    release_group_buffers()
    destroy_process_groups()  # gloo groups freed now, not at interpreter exit (pytorch#190489)
    failed = [r for r in results if r["status"] != "passed"]
    if failed:
        raise AssertionError("\n".join(f"rank {rank} {r['check']}:\n{r['error']}" for r in failed))


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs >= 2 GPUs")
def test_deepep_cuda_ops_against_cpu_reference_backward_and_compiled_moe():
    default = max(n for n in (2, 4, 8) if n <= max(NUM_GPUS, 2))
    world_size = int(os.environ.get("DEEPEP_TEST_WORLD_SIZE", default))
    if world_size not in (2, 4, 8) or world_size > NUM_GPUS:
        pytest.skip(f"DEEPEP_TEST_WORLD_SIZE={world_size}: use 2, 4 or 8 with that many GPUs ({NUM_GPUS} visible)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world_size, os.path.join(tmp, "init"), os.environ.get("OUT")),
            nprocs=world_size,
            start_method="spawn",
        )


@pytest.mark.skipif(NUM_GPUS < 1, reason="needs a GPU")
def test_deepep_cuda_ops_two_ranks_sharing_one_gpu():
    """DeepEP's real kernels (bf16, sync-free and FP8 dispatch, combine, backward) against the CPU reference on a
    one-GPU machine: two ranks on GPU 0 exchange through CUDA IPC as two GPUs would over NVLink."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(2, os.path.join(tmp, "init"), os.environ.get("OUT"), True),
            nprocs=2,
            start_method="spawn",
        )
