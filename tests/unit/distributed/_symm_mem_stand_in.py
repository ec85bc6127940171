"""A stand-in for NVSHMEM under torch's symmetric memory, so the symm_mem ops' CUDA kernels run on CPU tensors over
gloo (distributed/symm_mem_all_to_all.py): install it in a rank's own process."""

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan.distributed import symm_mem_all_to_all as ops


class StandIn:
    """NVSHMEM's all-to-all-v over gloo for CPU tensors, with its contract: every tensor argument is a symmetric
    allocation seen from its start, `out` holds what arrives, and `out_splits_offsets` gets the received splits
    and their offsets. It logs the send buffer of each call (its lane)."""

    def __init__(self):
        self.default = torch.ops.symm_mem.all_to_all_vdev.default  # the schema check_nvshmem reads
        self.symmetric: set[int] = set()
        self.send_buffers: list[int] = []

    def empty(self, *size, dtype=None, device=None):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        # what a fresh allocation may hold: bytes of all ones are NaN in bf16 and fp32
        tensor = (
            torch.full(shape, 255, dtype=torch.uint8) if dtype == torch.uint8 else torch.full(shape, -7, dtype=dtype)
        )
        self.symmetric.add(tensor.data_ptr())
        return tensor

    def __call__(self, input, out, in_splits, out_splits_offsets, group_name):
        for arg in (input, out, in_splits, out_splits_offsets):
            assert arg.data_ptr() in self.symmetric, "an all-to-all-v argument is not a symmetric allocation's start"
        assert input.dtype == out.dtype and input.is_contiguous() and out.is_contiguous()
        group = _resolve_process_group(group_name)
        send = in_splits.tolist()
        recv = torch.empty_like(in_splits)
        dist.all_to_all_single(recv, in_splits, group=group)
        assert int(recv.sum()) <= out.shape[0], "the receive view is smaller than what arrives"
        received = input.new_empty((int(recv.sum()), *input.shape[1:]))
        dist.all_to_all_single(received, input[: sum(send)].contiguous(), recv.tolist(), send, group=group)
        out[: received.shape[0]] = received
        out_splits_offsets[0] = recv
        out_splits_offsets[1] = recv.cumsum(0) - recv
        self.send_buffers.append(input.data_ptr())


def install_stand_in() -> StandIn:
    """In this rank's process: torch's symmetric memory as the stand-in, and the ops' CPU kernels replaced by their
    CUDA kernels, which then run on CPU tensors."""
    fake = StandIn()
    symm_mem.empty = fake.empty
    symm_mem.rendezvous = lambda tensor, group: None
    symm_mem.get_backend = lambda device: "NVSHMEM"
    symm_mem.is_nvshmem_available = lambda: True
    torch.ops.symm_mem.all_to_all_vdev = fake
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda: None
    ops.exchange_counts.register_kernel("cpu")(ops.exchange_counts_cuda)
    ops.all_to_all_v.register_kernel("cpu")(ops.all_to_all_v_cuda)
    return fake
