"""All-to-all-v with the split sizes on the device, as torch custom ops (no host read, so no rank waits on its host):

    torchtitan::symm_mem_exchange_counts(counts (ep * L,) int64, group_name) -> (ep * L,) int64
        block r of L values goes to rank r; block r of the result is what rank r sent this one
    torchtitan::symm_mem_all_to_all_v(x (S, H), send_splits (ep,), recv_splits (ep,), group_name, out_rows, lane)
        -> (out_rows, H): the rows every rank sent this one, rank-major; rows past sum(recv_splits) are padding

x's rows are grouped by destination (the first send_splits[0] go to rank 0, ...); rows past sum(send_splits) are
not sent. recv_splits (what each rank sends this one, from the counts' exchange) must not sum past out_rows, a static
bound the caller picks (worst case or capacity), so the fake kernel's sizes are static. The gradient of an
all-to-all-v is the reverse one (the splits swapped, x's S rows out), so autograd needs no saved layout.

CPU runs the reference over gloo (it reads the splits on the host; padding rows are NaN, so a use of them shows).
CUDA runs torch's NVSHMEM all-to-all-v (`torch.ops.symm_mem.all_to_all_vdev`) through symmetric buffers made once
per EP group at parallelize time (`get_or_create_buffers`; ops cannot take a process group, so they find them by
the group's name in the exchanges' registry, `distributed/group_buffers.py`): x is copied into a send buffer, the
peers read it (NVSHMEM get) into their receive buffers after the split exchange's barrier, and the rows are copied
out. A rank may refill a send buffer only once every peer has read it, so calls alternate between two lanes of
buffers: dispatch and the backward of combine use lane 0, combine and the backward of dispatch lane 1 (the MoE layer
runs them in pairs, forward and backward, as every recompute does), and the counts have their own; between two calls
on one lane lies a call on another, whose barrier every peer reaches only after finishing the earlier call.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan.distributed.group_buffers import (
    group_buffers,
    keep_group_buffers,
    release_group_buffers,
    required_group_buffers,
)

__all__ = [
    "COMBINE_LANE",
    "DISPATCH_LANE",
    "SymmMemBuffers",
    "all_to_all_v",
    "check_nvshmem",
    "exchange_counts",
    "get_or_create_buffers",
]

DISPATCH_LANE, COMBINE_LANE = 0, 1

_VDEV_ARGUMENTS = ["input", "out", "in_splits", "out_splits_offsets", "group_name"]
_NVSHMEM_HINT = (
    "parallelism.expert_parallel_comm_backend='symm_mem' on CUDA needs torch's NVSHMEM symmetric memory: a torch "
    "built with NVSHMEM and the nvidia-nvshmem package of its CUDA (pip install nvidia-nvshmem-cu13, or -cu12); "
    "otherwise use --parallelism.expert_parallel_comm_backend standard or deepep"
)


@torch.library.custom_op("torchtitan::symm_mem_exchange_counts", mutates_args=(), device_types="cpu")
def exchange_counts(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=_resolve_process_group(group_name))
    return out


@torch.library.custom_op("torchtitan::symm_mem_all_to_all_v", mutates_args=(), device_types="cpu")
def all_to_all_v(
    x: torch.Tensor,
    send_splits: torch.Tensor,
    recv_splits: torch.Tensor,
    group_name: str,
    out_rows: int,
    lane: int,
) -> torch.Tensor:
    send, recv = send_splits.tolist(), recv_splits.tolist()  # the reference may read them on the host
    out = x.new_empty((sum(recv), x.shape[1]))
    dist.all_to_all_single(out, x[: sum(send)].contiguous(), recv, send, group=_resolve_process_group(group_name))
    if out.shape[0] > out_rows:  # checked after the exchange, so no other rank is left waiting
        raise RuntimeError(
            f"symm_mem all-to-all-v received {out.shape[0]} rows, more than its bound of {out_rows}: every EP rank "
            "must send as many tokens, and each rank at most its capacity (TokenDispatcher.apply_capacity)"
        )
    return torch.cat([out, out.new_full((out_rows - out.shape[0], x.shape[1]), float("nan"))])


@exchange_counts.register_fake
def _(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(counts)


@all_to_all_v.register_fake
def _(x, send_splits, recv_splits, group_name, out_rows, lane) -> torch.Tensor:
    return x.new_empty((out_rows, x.shape[1]))


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, send_splits, recv_splits, ctx.group_name, _, ctx.lane = inputs
    ctx.num_rows = x.shape[0]
    ctx.save_for_backward(send_splits, recv_splits)


def _backward(ctx, grad: torch.Tensor) -> tuple:
    send_splits, recv_splits = ctx.saved_tensors
    grad_x = all_to_all_v(grad.contiguous(), recv_splits, send_splits, ctx.group_name, ctx.num_rows, 1 - ctx.lane)
    return grad_x, None, None, None, None, None


all_to_all_v.register_autograd(_backward, setup_context=_setup_context)


# CUDA: NVSHMEM symmetric buffers.


@dataclass
class SymmMemBuffers:
    """One EP group's symmetric tensors (the same shapes on every rank). Row buffers are bytes, viewed per call as
    (rows, H) of the tokens' dtype: lane 0 sends up to `send_rows` rows and receives up to `recv_rows`, lane 1 the
    other way round."""

    group_name: str
    world_size: int
    send_rows: int
    recv_rows: int
    row_bytes: int
    num_counts: int
    send: tuple[torch.Tensor, torch.Tensor]  # per lane, uint8
    recv: tuple[torch.Tensor, torch.Tensor]
    in_splits: tuple[torch.Tensor, torch.Tensor]  # (ep,) int64
    out_splits_offsets: tuple[torch.Tensor, torch.Tensor]  # (2, ep) int64, written by the op
    counts_send: torch.Tensor  # (num_counts,) int64
    counts_recv: torch.Tensor
    counts_in_splits: torch.Tensor  # (ep,) int64: num_counts / ep each
    counts_out_splits_offsets: torch.Tensor

    def covers(self, send_rows: int, recv_rows: int, row_bytes: int, num_counts: int) -> bool:
        return (
            self.send_rows >= send_rows
            and self.recv_rows >= recv_rows
            and self.row_bytes >= row_bytes
            and self.num_counts == num_counts
        )

    def rows(self, lane: int, sending: bool, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """The first num_rows rows of a lane's send or receive buffer as (num_rows, H) of like's dtype (a view at
        offset 0: torch's symmetric-memory ops find the allocation by the view's pointer)."""
        buffer = self.send[lane] if sending else self.recv[lane]
        num_bytes = num_rows * like.shape[1] * like.element_size()
        if num_bytes > buffer.numel():
            raise RuntimeError(
                f"symm_mem exchange: {num_rows} rows of {like.shape[1]} x {like.dtype} need {num_bytes} bytes, the "
                f"buffer of group {self.group_name!r} holds {buffer.numel()}; it is sized at parallelize time from "
                "the largest micro-batch of the job (training and validation batch sizes and sequence lengths)"
            )
        return buffer[:num_bytes].view(like.dtype).view(num_rows, like.shape[1])


_EXCHANGE = "symm_mem"  # its key in the registry of group buffers


def get_or_create_buffers(
    group: dist.ProcessGroup, send_rows: int, recv_rows: int, row_bytes: int, num_counts: int
) -> SymmMemBuffers:
    """The group's buffers, created (or re-created larger) for calls of up to send_rows x row_bytes out and
    recv_rows x row_bytes in, and num_counts counts. Collective over every rank of the job (NVSHMEM allocates
    over the world): call it at parallelize time with the same sizes on every rank, never in forward."""
    current = group_buffers(_EXCHANGE, group.group_name)
    if current is not None and current.covers(send_rows, recv_rows, row_bytes, num_counts):
        return current
    if current is not None:
        send_rows, recv_rows = max(send_rows, current.send_rows), max(recv_rows, current.recv_rows)
        row_bytes = max(row_bytes, current.row_bytes)
        release_group_buffers(_EXCHANGE, group.group_name)  # before the new ones take their memory
    buffers = _create_buffers(group, send_rows, recv_rows, row_bytes, num_counts)
    keep_group_buffers(_EXCHANGE, group.group_name, buffers, _free)
    return buffers


def _free(buffers: SymmMemBuffers) -> None:
    torch.cuda.synchronize()  # no queued exchange still reads them; the registry drops the last reference


def check_nvshmem() -> None:
    """Raise naming the fix where this torch cannot run the CUDA kernels: NVSHMEM, and the all-to-all-v signature
    they call (torch >= 2.9: `(input, out, in_splits, out_splits_offsets, group_name)`)."""
    from torch.distributed import _symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        raise ImportError(_NVSHMEM_HINT)
    schema = torch.ops.symm_mem.all_to_all_vdev.default._schema
    if [argument.name for argument in schema.arguments] != _VDEV_ARGUMENTS:
        raise ImportError(
            f"this torch's {schema} is not the all-to-all-v the symm_mem backend calls "
            f"({', '.join(_VDEV_ARGUMENTS)}; torch >= 2.9); upgrade torch or use the standard backend"
        )


def _create_buffers(
    group: dist.ProcessGroup, send_rows: int, recv_rows: int, row_bytes: int, num_counts: int
) -> SymmMemBuffers:
    from torch.distributed import _symmetric_memory as symm_mem

    check_nvshmem()
    _check_one_host(group)
    device = torch.device("cuda", torch.cuda.current_device())
    if symm_mem.get_backend(device) != "NVSHMEM":
        symm_mem.set_backend("NVSHMEM")  # before any symmetric allocation of the process
    group_name, world_size = group.group_name, group.size()

    def symmetric(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = symm_mem.empty(shape, dtype=dtype, device=device)
        symm_mem.rendezvous(tensor, group_name)
        return tensor

    def lane_pair(rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(symmetric((r * row_bytes,), torch.uint8) for r in rows)

    counts_in_splits = symmetric((world_size,), torch.int64).fill_(num_counts // world_size)
    return SymmMemBuffers(
        group_name=group_name,
        world_size=world_size,
        send_rows=send_rows,
        recv_rows=recv_rows,
        row_bytes=row_bytes,
        num_counts=num_counts,
        send=lane_pair((send_rows, recv_rows)),
        recv=lane_pair((recv_rows, send_rows)),
        in_splits=tuple(symmetric((world_size,), torch.int64) for _ in range(2)),
        out_splits_offsets=tuple(symmetric((2, world_size), torch.int64) for _ in range(2)),
        counts_send=symmetric((num_counts,), torch.int64),
        counts_recv=symmetric((num_counts,), torch.int64),
        counts_in_splits=counts_in_splits,
        counts_out_splits_offsets=symmetric((2, world_size), torch.int64),
    )


def _check_one_host(group: dist.ProcessGroup) -> None:
    hosts: list[str | None] = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise RuntimeError(
            f"expert_parallel_comm_backend='symm_mem' exchanges within one host (NVLink); this EP group spans "
            f"{sorted(set(hosts))}: use an expert_parallel_degree of at most the GPUs per host, or the deepep backend"
        )


def _buffers(group_name: str) -> SymmMemBuffers:
    return required_group_buffers(
        _EXCHANGE, group_name, "apply SymmMemExpertParallel to the MoE layer (or call get_or_create_buffers)"
    )


@exchange_counts.register_kernel("cuda")
def exchange_counts_cuda(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    buffers = _buffers(group_name)
    buffers.counts_send.copy_(counts)
    torch.ops.symm_mem.all_to_all_vdev(
        buffers.counts_send,
        buffers.counts_recv,
        buffers.counts_in_splits,
        buffers.counts_out_splits_offsets,
        group_name,
    )
    return buffers.counts_recv.clone()


@all_to_all_v.register_kernel("cuda")
def all_to_all_v_cuda(x, send_splits, recv_splits, group_name, out_rows, lane) -> torch.Tensor:
    buffers = _buffers(group_name)
    send, recv = buffers.rows(lane, True, x.shape[0], x), buffers.rows(lane, False, out_rows, x)
    # on the device, queued before the exchange: past the bound the receive buffer would overflow
    torch._assert_async(recv_splits.sum() <= out_rows, "symm_mem all-to-all-v: more rows than its bound")
    send.copy_(x)
    buffers.in_splits[lane].copy_(send_splits)
    torch.ops.symm_mem.all_to_all_vdev(
        send, recv, buffers.in_splits[lane], buffers.out_splits_offsets[lane], group_name
    )
    return recv.clone()
