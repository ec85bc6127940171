"""Expert parallelism over gloo ranks computes exactly what one process computes on all the tokens."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from tests.unit.distributed._spawn import run_distributed
from torchtitan.distributed.expert_parallel.styles import ExpertParallel
from torchtitan.kernels.permute import expert_major_order
from torchtitan.models.moe import MoE, MoEArgs

DIM, HIDDEN, TOKENS_PER_RANK = 16, 32, 12


def _build_moe(use_grouped_mm: bool) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="softmax", use_grouped_mm=use_grouped_mm)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(init_std=0.02)
    return moe


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(1, TOKENS_PER_RANK, DIM, generator=torch.Generator().manual_seed(100 + rank))


def _ep_matches_single_process(rank: int, world_size: int, use_grouped_mm: bool) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    reference = _build_moe(use_grouped_mm)
    all_tokens = torch.cat([_tokens(r) for r in range(world_size)], dim=1)
    ref_out = reference(all_tokens)
    ref_out.pow(2).sum().backward()

    moe = _build_moe(use_grouped_mm)
    parallelize_module(moe, mesh["ep"], ExpertParallel())
    assert isinstance(moe.experts.w1, DTensor) and moe.experts.w1.to_local().shape[0] == 8 // world_size
    out = moe(_tokens(rank))
    out.pow(2).sum().backward()

    # bf16 grouped GEMMs round the same rows the same way; only sums over tokens change order
    tol = dict(rtol=2e-2, atol=2e-3) if use_grouped_mm else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out[:, rank * TOKENS_PER_RANK : (rank + 1) * TOKENS_PER_RANK], **tol)
    experts_per_rank = 8 // world_size
    for name in ("w1", "w2", "w3"):
        local_grad = getattr(moe.experts, name).grad.to_local()
        ref_grad = getattr(reference.experts, name).grad[rank * experts_per_rank : (rank + 1) * experts_per_rank]
        torch.testing.assert_close(local_grad, ref_grad, **tol)
    # dense parameters see only this rank's tokens: their gradients sum over ranks (what FSDP does)
    gate_grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, reference.router.gate.weight.grad, **tol)


def test_expert_parallel_2_ranks_matches_single_process_fp32():
    run_distributed(_ep_matches_single_process, 2, False)


def test_expert_parallel_4_ranks_matches_single_process_grouped_mm():
    run_distributed(_ep_matches_single_process, 4, True)


def test_expert_major_order_keeps_source_order_within_an_expert_and_puts_unrouted_last():
    # received rows, rank-major: r0e0 r0e0 r0e2 | r1e0 r1e1 r1e1 r1e1 -> expert-major: e0(r0,r0,r1) e1(r1 x3) e2(r0)
    assert expert_major_order(torch.tensor([0, 0, 2, 0, 1, 1, 1]), 3).tolist() == [0, 1, 3, 4, 5, 6, 2]
    # DeepEP slots (2 received tokens x top-2): -1 = expert on another rank, sorted after every local expert
    assert expert_major_order(torch.tensor([[1, -1], [0, 1]]), 2).tolist() == [2, 0, 3, 1]
    # int16 keys: the same stable order as sorting the ids themselves, up to the largest expert count allowed
    for num_experts in (64, 32766):
        ids = torch.randint(-1, num_experts, (4000, 6), generator=torch.Generator().manual_seed(num_experts))
        flat = ids.reshape(-1)
        expected = torch.argsort(torch.where(flat >= 0, flat, num_experts), stable=True)
        assert torch.equal(expert_major_order(ids, num_experts), expected)
    with pytest.raises(ValueError, match="below 32767"):
        expert_major_order(torch.zeros(4, dtype=torch.int64), 2**15 - 1)
