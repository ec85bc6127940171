"""`torch.ops.torchtitan.symm_mem_*` (distributed/symm_mem_all_to_all.py) on gloo ranks: registration (opcheck), the
CPU reference against a plain all-to-all forward and backward, and the CUDA kernels' Python side (buffers, views,
lanes) on CPU through a stand-in for NVSHMEM's all-to-all-v."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from tests.unit.distributed._spawn import run_distributed
from tests.unit.distributed._symm_mem_stand_in import install_stand_in
from torchtitan.distributed import symm_mem_all_to_all as ops
from torchtitan.distributed.group_buffers import release_group_buffers

DIM = 6


def _send_splits(rank: int, world_size: int) -> torch.Tensor:
    """Uneven rows per destination; rank 2 sends nothing at all."""
    if rank == 2:
        return torch.zeros(world_size, dtype=torch.int64)
    return torch.tensor([(rank + 2 * dst) % 5 for dst in range(world_size)])


def _exchange_splits(send_splits: torch.Tensor) -> torch.Tensor:
    recv_splits = torch.empty_like(send_splits)
    dist.all_to_all_single(recv_splits, send_splits)
    return recv_splits


def _opcheck(rank: int, world_size: int) -> None:
    name = dist.group.WORLD.group_name
    x = torch.randn(5, DIM, requires_grad=True)
    splits = torch.tensor([5])  # every row sent: no padding either way (opcheck compares outputs, and NaN != NaN)
    torch.library.opcheck(torch.ops.torchtitan.symm_mem_all_to_all_v.default, (x, splits, splits, name, 5, 0))
    torch.library.opcheck(torch.ops.torchtitan.symm_mem_exchange_counts.default, (torch.arange(4), name))


def test_opcheck_single_rank_group():
    run_distributed(_opcheck, 1)


def _matches_plain_all_to_all(rank: int, world_size: int) -> None:
    """Forward: the rows a plain all-to-all-v receives, then NaN padding up to out_rows; the rows of x past the send
    splits are not sent. Backward: the gradient of the plain all-to-all-v, and none for the rows not sent."""
    name = dist.group.WORLD.group_name
    send_splits = _send_splits(rank, world_size)
    recv_splits = _exchange_splits(send_splits)
    num_sent, num_received, out_rows = int(send_splits.sum()), int(recv_splits.sum()), 4 * world_size + 3
    x = torch.randn(num_sent + 2, DIM, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out = ops.all_to_all_v(x, send_splits, recv_splits, name, out_rows, ops.DISPATCH_LANE)

    x_ref = x.detach()[:num_sent].clone().requires_grad_()
    expected = all_to_all_single_autograd(x_ref, recv_splits.tolist(), send_splits.tolist(), dist.group.WORLD)
    expected = expected.wait() if hasattr(expected, "wait") else expected
    assert out.shape == (out_rows, DIM)
    torch.testing.assert_close(out[:num_received], expected, rtol=0, atol=0)
    assert out[num_received:].isnan().all()

    upstream = torch.randn(out_rows, DIM, generator=torch.Generator().manual_seed(10 + rank))
    (out[:num_received] * upstream[:num_received]).sum().backward()
    (expected * upstream[:num_received]).sum().backward()
    torch.testing.assert_close(x.grad[:num_sent], x_ref.grad, rtol=0, atol=0)
    assert x.grad.shape == x.shape and x.grad[num_sent:].isnan().all()  # padding of the reverse exchange

    counts = torch.arange(3 * world_size) + 100 * rank  # block r (3 values) goes to rank r
    received = ops.exchange_counts(counts, name).view(world_size, 3)
    for src in range(world_size):
        assert received[src].tolist() == [100 * src + 3 * rank + i for i in range(3)]


def _refuses_more_rows_than_its_bound(rank: int, world_size: int) -> None:
    name = dist.group.WORLD.group_name
    splits = torch.full((world_size,), 2)
    with pytest.raises(RuntimeError, match=f"received {2 * world_size} rows, more than its bound of 3"):
        ops.all_to_all_v(torch.ones(2 * world_size, DIM), splits, splits, name, 3, ops.DISPATCH_LANE)


def _reference_checks(rank: int, world_size: int) -> None:
    _matches_plain_all_to_all(rank, world_size)
    _refuses_more_rows_than_its_bound(rank, world_size)


def test_reference_matches_a_plain_all_to_all_4_ranks_uneven_with_an_empty_rank():
    run_distributed(_reference_checks, 4)


def _cuda_kernels_match_the_reference(rank: int, world_size: int) -> None:
    """The CUDA kernels' rows (copied in and out of views of the byte buffers, in two dtypes; there and back over
    both lanes) and counts are the reference's; a call past the buffers' size is refused on the host."""
    name = dist.group.WORLD.group_name
    send_splits = _send_splits(rank, world_size)
    recv_splits = _exchange_splits(send_splits)
    num_sent, num_received, out_rows = int(send_splits.sum()), int(recv_splits.sum()), 4 * world_size + 3
    x = torch.randn(num_sent + 2, DIM, generator=torch.Generator().manual_seed(rank))
    counts = torch.arange(3 * world_size) + 100 * rank
    dtypes = (torch.float32, torch.bfloat16)
    expected_rows = [ops.all_to_all_v(x.to(dtype), send_splits, recv_splits, name, out_rows, 0) for dtype in dtypes]
    expected_counts = ops.exchange_counts(counts, name)

    install_stand_in()
    ops.get_or_create_buffers(dist.group.WORLD, x.shape[0], out_rows, DIM * 4, counts.numel())
    for expected, dtype in zip(expected_rows, dtypes, strict=True):
        got = ops.all_to_all_v(x.to(dtype), send_splits, recv_splits, name, out_rows, ops.DISPATCH_LANE)
        assert got.shape == (out_rows, DIM) and got.dtype == dtype
        torch.testing.assert_close(got[:num_received], expected[:num_received], rtol=0, atol=0)
        back = ops.all_to_all_v(got, recv_splits, send_splits, name, x.shape[0], ops.COMBINE_LANE)
        torch.testing.assert_close(back[:num_sent], x.to(dtype)[:num_sent], rtol=0, atol=0)
    assert torch.equal(ops.exchange_counts(counts, name), expected_counts)
    with pytest.raises(RuntimeError, match=r"need \d+ bytes, the buffer of group .* holds"):
        ops.all_to_all_v(torch.zeros(x.shape[0] + 1, DIM), send_splits, recv_splits, name, out_rows, 0)
    release_group_buffers()


def test_cuda_kernels_through_a_stand_in_match_the_reference_4_ranks():
    run_distributed(_cuda_kernels_match_the_reference, 4)
