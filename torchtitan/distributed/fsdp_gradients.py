"""FSDP2's reduced gradients allocated from the compute stream's memory pool instead of the reduce-scatter stream's.

FSDP2 allocates each reduce-scatter output on its reduce-scatter stream and keeps it as the sharded gradient until
the optimizer step. The caching allocator keeps one pool per stream, so the gradients (8.6 GiB per rank on
16B_bench4, FSDP x EP=2) grow their own pool during backward while the activations freed by that same backward sit
idle in the compute stream's pool: the job reserves the sum of the two pools' peaks. Allocated from the compute
stream's pool, the gradients reuse the activations' memory.

Safety: FSDP makes the reduce-scatter stream wait for the compute stream before it allocates the output, so earlier
compute-stream users of the block are done before the reduce-scatter writes it; `record_stream` keeps the block from
being reused by the compute stream until the reduce-scatter stream has finished with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

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
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
