"""CUDA kernels of `torch.ops.deepep.*`: DeepEP's high-throughput (normal) kernels through `deep_ep.Buffer`.

Streams: every call hands DeepEP an event captured on the compute stream (`previous_event`), so every tensor DeepEP
reads (the bf16 cast, FP8 values and scales) must be queued before that capture. The kernels run with
`async_finish=True`, and the compute stream waits on DeepEP's event before returning (a custom op cannot return an
event; overlap comes from work on other streams, see `DeepEPMoE`). Outputs are allocated on the compute stream and
recorded on DeepEP's, so the allocator cannot reuse them early.

Tokens travel in bf16 (`WIRE_DTYPE`; DeepEP's combine is bf16-only), or with `fp8` as FP8 with one scale per 128
channels. The non-cached dispatch syncs with the host for the received counts unless `sync_free` (worst-case
allocation, `num_worst_tokens`, intranode only); combine and the cached dispatch never sync.
"""

from __future__ import annotations

import torch

from torchtitan.distributed.deepep.buffer import WIRE_DTYPE, kernel_buffer
from torchtitan.kernels.float8 import dequantize_blockwise, quantize_blockwise
from torchtitan.kernels.permute import expert_major_order

__all__ = ["cached_dispatch", "combine", "dispatch"]


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    group_name: str,
    sync_free: bool = False,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    buffer = kernel_buffer(group_name, "cuda", x.shape[-1])
    runtime = buffer.runtime
    num_local_experts = num_experts // buffer.world_size
    # intranode only: DeepEPExpertParallel refuses it for a group that spans nodes
    num_worst_tokens = x.shape[0] * buffer.world_size if sync_free else 0
    topk_idx = topk_idx.to(torch.int64).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    wire_x = quantize_blockwise(x) if fp8 else _to_wire(x)  # fp8: (values, scales), DeepEP's FP8 dispatch

    # Captured after every input DeepEP reads is queued: its stream waits for this event and nothing later.
    previous_event = buffer.deep_ep.Buffer.capture()
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, layout_event = (
        runtime.get_dispatch_layout(
            topk_idx, num_experts, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False
        )
    )
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_list, handle, event = runtime.dispatch(
        wire_x,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        config=buffer.dispatch_config,
        previous_event=layout_event,
        async_finish=True,
        allocate_on_comm_stream=False,
        num_worst_tokens=num_worst_tokens,
    )
    event.current_stream_wait()
    recv_x = dequantize_blockwise(*recv_x) if fp8 else recv_x
    if sync_free:
        # recv_topk_idx is -1 on every padding row (DeepEP clears them), so the counts and the slot order see
        # only the received copies; the slots of masked entries and padding follow them.
        local_ids = recv_topk_idx.reshape(-1)
        bins = torch.where(local_ids >= 0, local_ids, num_local_experts)  # masked and padding: one extra bin
        counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=x.device)
        # a view at offset 0: inductor asserts that custom-op outputs are 16-byte aligned
        counts = counts.scatter_add_(0, bins, torch.ones_like(bins))[:num_local_experts]
        slots = expert_major_order(recv_topk_idx, num_local_experts)
        return recv_x.to(x.dtype), recv_topk_idx, recv_topk_weights, counts, slots, list(handle)

    # DeepEP already synced the per-expert counts to the host; reuse them instead of syncing again. The copy to the
    # device goes from pinned memory without blocking: a pageable copy would hold the host until the compute stream
    # reached it, i.e. until this dispatch had finished on the GPU, so the host could not queue the experts ahead.
    num_recv_tokens_per_expert = torch.tensor(num_recv_list, dtype=torch.int64, pin_memory=x.is_cuda).to(
        x.device, non_blocking=True
    )
    # slots of the non-masked (received token, local expert) pairs, local-expert-major
    slots = expert_major_order(recv_topk_idx, num_local_experts)[: sum(num_recv_list)].clone()
    return recv_x.to(x.dtype), recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, slots, list(handle)


def combine(
    x: torch.Tensor, handle: list[torch.Tensor], group_name: str, topk_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = kernel_buffer(group_name, "cuda", x.shape[-1])
    if topk_weights is not None:
        topk_weights = topk_weights.to(torch.float32).contiguous()
    wire_x = _to_wire(x)
    combined_x, combined_topk_weights, event = buffer.runtime.combine(
        wire_x,
        tuple(handle),
        topk_weights=topk_weights,
        config=buffer.combine_config,
        previous_event=buffer.deep_ep.Buffer.capture(),
        async_finish=True,
        allocate_on_comm_stream=False,
    )
    event.current_stream_wait()
    if combined_topk_weights is None:
        combined_topk_weights = x.new_empty((combined_x.shape[0], 0), dtype=torch.float32)
    return combined_x.to(x.dtype), combined_topk_weights


def cached_dispatch(x: torch.Tensor, handle: list[torch.Tensor], group_name: str) -> torch.Tensor:
    buffer = kernel_buffer(group_name, "cuda", x.shape[-1])
    wire_x = _to_wire(x)
    recv_x, _, _, _, _, event = buffer.runtime.dispatch(
        wire_x,
        handle=tuple(handle),
        config=buffer.dispatch_config,
        previous_event=buffer.deep_ep.Buffer.capture(),
        async_finish=True,
        allocate_on_comm_stream=False,
    )
    event.current_stream_wait()
    return recv_x.to(x.dtype)


def _to_wire(x: torch.Tensor) -> torch.Tensor:
    return x.to(WIRE_DTYPE).contiguous()
