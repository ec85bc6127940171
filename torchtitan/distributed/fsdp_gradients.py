"""FSDP2's reduced gradients allocated from the compute stream's memory pool instead of the reduce-scatter stream's.

FSDP2 keeps each reduce-scatter output, allocated on its own stream, as the sharded gradient until the optimizer
step. The allocator keeps one pool per stream, so the gradients grow their own pool while the activations freed by
the same backward sit idle in the compute stream's: the job reserves both peaks. From the compute stream's pool the
gradients reuse the activations' memory. Safe: FSDP makes the reduce-scatter stream wait for the compute stream
before allocating, and `record_stream` keeps the block until the reduce-scatter stream is done with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from torchtitan.distributed.utils import reduce_scatter_tensor

__all__ = ["ComputePoolReduceScatter"]


class ComputePoolReduceScatter(ReduceScatter):
    """torch.distributed.reduce_scatter_tensor, its buffers taken from the default stream's pool on CUDA."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(*size, dtype=dtype, device=device)
        user = torch.cuda.current_stream(device)
        compute = torch.cuda.default_stream(device)
        if user == compute:
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(compute):
            tensor = torch.empty(*size, dtype=dtype, device=device)
        tensor.record_stream(user)
        return tensor

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        return reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
