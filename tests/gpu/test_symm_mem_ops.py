"""The symm_mem exchange's CUDA kernels (torch's NVSHMEM all-to-all-v) against their CPU gloo reference, their
backward, and an MoE layer on them (standard EP's results, compiled, with a capacity factor, no host sync).

One command, one node with >= 2 GPUs (the test spawns one process per GPU itself):

    OUT=/tmp/symm_mem python -m pytest -q tests/gpu/test_symm_mem_ops.py

SYMM_MEM_TEST_WORLD_SIZE picks the number of GPUs (default 2). With OUT set, rank 0 writes
$OUT/symm_mem_gpu_summary.json (per-check status, errors, timings, versions). Skips cleanly without CUDA, without
NVSHMEM, or with fewer than 2 GPUs. Two ranks on one GPU need CUDA MPS (NVSHMEM runs one PE per GPU otherwise, and
may refuse two even under MPS): start the MPS daemon, then set SYMM_MEM_TEST_SHARE_GPU=1 to run the op checks with
both ranks on GPU 0 (`test_symm_mem_ops_two_ranks_sharing_one_gpu`, which sets NVSHMEM's MPS variables unless given:
passed on one H200 with NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 and NVSHMEM_DISABLE_NCCL=1); a failure there
that names NVSHMEM's initialization means this NVSHMEM cannot share a GPU: run the 2-GPU test.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtitan.distributed import symm_mem_all_to_all as ops
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.distributed.expert_parallel.symm_mem_dispatcher import SymmMemExpertParallel
from torchtitan.distributed.group_buffers import release_group_buffers
from torchtitan.distributed.utils import destroy_process_groups
from torchtitan.models.moe import MoE, MoEArgs

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HIDDEN, NUM_EXPERTS, TOP_K, NUM_TOKENS = 512, 16, 4, 128
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _nvshmem_missing() -> str | None:
    if NUM_GPUS == 0:
        return "needs CUDA"
    try:
        ops.check_nvshmem()
    except ImportError as err:
        return str(err)
    return None


pytestmark = pytest.mark.skipif(_nvshmem_missing() is not None, reason=_nvshmem_missing() or "")


def _splits(rank: int, world_size: int, gen: torch.Generator) -> torch.Tensor:
    """Uneven rows per destination, some empty."""
    return torch.randint(0, 40, (world_size,), generator=gen) * (torch.rand(world_size, generator=gen) > 0.2)


def _check_ops_match_cpu_reference(rank, world_size, cuda_group, cpu_group):
    """Rows (bf16 and fp32, there and back over both lanes), counts and the backward equal the reference's."""
    gen = torch.Generator().manual_seed(rank)
    send_splits = _splits(rank, world_size, gen)
    recv_splits = torch.empty_like(send_splits)
    dist.all_to_all_single(recv_splits, send_splits, group=cpu_group)
    num_sent, num_received = int(send_splits.sum()), int(recv_splits.sum())
    out_rows, rows = 40 * world_size, 40 * world_size  # every rank's bound: the worst case of _splits
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        ref = ops.all_to_all_v(x, send_splits, recv_splits, cpu_group.group_name, out_rows, 0)
        got = ops.all_to_all_v(x.cuda(), send_splits.cuda(), recv_splits.cuda(), cuda_group.group_name, out_rows, 0)
        assert got.is_cuda and torch.equal(got[:num_received].cpu(), ref[:num_received]), f"{dtype} rows differ"
        back = ops.all_to_all_v(got, recv_splits.cuda(), send_splits.cuda(), cuda_group.group_name, rows, 1)
        assert torch.equal(back[:num_sent].cpu(), x[:num_sent]), f"{dtype} rows do not come back"
    counts = torch.arange(3 * world_size) + 100 * rank
    got_counts = ops.exchange_counts(counts.cuda(), cuda_group.group_name)
    assert torch.equal(got_counts.cpu(), ops.exchange_counts(counts, cpu_group.group_name))

    x = torch.randn(rows, HIDDEN, generator=gen)
    upstream = torch.randn(out_rows, HIDDEN, generator=gen)
    grads = []
    for x_, device_group, device in ((x, cpu_group, "cpu"), (x.cuda(), cuda_group, "cuda")):
        x_ = x_.clone().requires_grad_()
        out = ops.all_to_all_v(x_, send_splits.to(device), recv_splits.to(device), device_group.group_name, out_rows, 0)
        (out[:num_received] * upstream[:num_received].to(device)).sum().backward()
        grads.append(x_.grad[:num_sent].cpu())
    torch.testing.assert_close(grads[1], grads[0])


def _build(mesh, style) -> MoE:
    """fp32 weights and tokens (the routed experts' GEMMs run in bf16)."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=NUM_EXPERTS, num_shared_experts=1, top_k=TOP_K, score_func="sigmoid", route_norm=True)
    moe = MoE(args, HIDDEN, 2 * HIDDEN)
    moe.init_weights(init_std=0.02)
    moe.cuda()
    parallelize_module(moe, mesh, style)
    return moe


def _symm_mem(max_tokens: int, capacity_factor: float | None = None) -> SymmMemExpertParallel:
    return SymmMemExpertParallel(max_tokens, capacity_factor, itemsize=4)  # fp32 tokens


def _forward_backward(moe: MoE, x: torch.Tensor, call=None):
    x = x.clone().requires_grad_()
    out = (call or moe)(x)
    out.float().pow(2).sum().backward()
    grads = {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for n, p in moe.named_parameters()
    }
    moe.zero_grad()
    return out.detach(), x.grad, grads


def _assert_close(got, want, label: str) -> None:
    torch.testing.assert_close(got[0], want[0], **BF16_TOL, msg=label)
    torch.testing.assert_close(got[1], want[1], **BF16_TOL, msg=label)
    for name, grad in got[2].items():
        torch.testing.assert_close(grad, want[2][name], **BF16_TOL, msg=f"{label}: {name}")


def _check_moe_matches_standard_compiled_and_without_host_syncs(rank, world_size, cuda_group, cpu_group):
    """The symm_mem MoE trains like the standard EP one (eager and compiled), a generous capacity factor changes
    nothing, and its forward and backward make no synchronizing CUDA call (torch's sync debug mode raises)."""
    torch._dynamo.config.capture_scalar_outputs = True
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    x = torch.randn(2, NUM_TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(rank)).cuda()
    reference = _forward_backward(_build(mesh, ExpertParallel()), x)
    moe = _build(mesh, _symm_mem(NUM_TOKENS))
    _assert_close(_forward_backward(moe, x), reference, "symm_mem vs standard EP")
    _assert_close(_forward_backward(moe, x, torch.compile(moe, fullgraph=True)), reference, "compiled")
    generous = _build(mesh, _symm_mem(NUM_TOKENS, capacity_factor=float(world_size)))
    _assert_close(_forward_backward(generous, x), reference, "capacity factor = EP")
    tight = _build(mesh, _symm_mem(NUM_TOKENS, capacity_factor=1.0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in (moe, tight):
            layer(x.clone().requires_grad_()).float().pow(2).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _measure_exchange(rank, world_size, cuda_group, cpu_group):
    """Not a check: one MoE layer's forward + backward, symm_mem against the standard backend (for the summary)."""
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    x = torch.randn(4, 1024, HIDDEN, device="cuda")
    timings = {}
    for name, style in (("standard", ExpertParallel()), ("symm_mem", _symm_mem(4096))):
        moe, times = _build(mesh, style), []
        for step in range(12):
            torch.cuda.synchronize()
            dist.barrier(group=cpu_group)
            start = time.perf_counter()
            moe(x.clone().requires_grad_()).float().sum().backward()
            torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - start)
        timings[f"{name}_moe_forward_backward_ms_median"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    return timings


_OP_CHECKS = (_check_ops_match_cpu_reference,)
_CHECKS = (*_OP_CHECKS, _check_moe_matches_standard_compiled_and_without_host_syncs, _measure_exchange)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str | None, share_gpu: bool = False) -> None:
    """One rank. With `share_gpu` every rank runs on GPU 0 over gloo (NCCL refuses two ranks on one GPU) and only
    the op checks run."""
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
    # the op checks' largest call: 40 x EP rows each way, fp32
    ops.get_or_create_buffers(cuda_group, 40 * world_size, 40 * world_size, HIDDEN * 4, 3 * world_size)
    checks = _OP_CHECKS if share_gpu else _CHECKS
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
            "passed": all(r["status"] == "passed" for rank_results in per_rank for r in rank_results),
            "ranks": per_rank,
        }
        name = "symm_mem_gpu_summary_shared_gpu.json" if share_gpu else "symm_mem_gpu_summary.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(summary, f, indent=2)
    release_group_buffers()
    destroy_process_groups()
    failed = [r for r in results if r["status"] != "passed"]
    if failed:
        raise AssertionError("\n".join(f"rank {rank} {r['check']}:\n{r['error']}" for r in failed))


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs >= 2 GPUs (one NVSHMEM PE per GPU)")
def test_symm_mem_cuda_ops_against_cpu_reference_and_moe():
    world_size = int(os.environ.get("SYMM_MEM_TEST_WORLD_SIZE", 2))
    if not 2 <= world_size <= NUM_GPUS:
        pytest.skip(f"SYMM_MEM_TEST_WORLD_SIZE={world_size}: use 2..{NUM_GPUS} (the GPUs visible)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world_size, os.path.join(tmp, "init"), os.environ.get("OUT")),
            nprocs=world_size,
            start_method="spawn",
        )


@pytest.mark.skipif(
    os.environ.get("SYMM_MEM_TEST_SHARE_GPU") != "1",
    reason="two NVSHMEM PEs on one GPU need CUDA MPS: start its daemon and set SYMM_MEM_TEST_SHARE_GPU=1 (or run the "
    "2-GPU test)",
)
def test_symm_mem_ops_two_ranks_sharing_one_gpu(monkeypatch):
    # NVSHMEM under MPS: every PE may use the whole GPU (else it wants CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / PEs),
    # and NCCL, which MPS disables, is not looked for
    for name in ("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "NVSHMEM_DISABLE_NCCL"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(2, os.path.join(tmp, "init"), os.environ.get("OUT"), True),
            nprocs=2,
            start_method="spawn",
        )
