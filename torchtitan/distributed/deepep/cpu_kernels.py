"""CPU reference kernels of `torch.ops.deepep.*` over torch.distributed (gloo all_to_all_single): the contract of
ops.py, which the CUDA kernels are checked against. Combine sums per source token in fp32. Sync-free, every rank must
send the same T (this reference raises); padding rows hold NaN and recv_topk_idx -1, so a test sees any use of them.
Host syncs (`.tolist()`) are fine here: this is the reference, not the hot path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.distributed.deepep.buffer import kernel_buffer
from torchtitan.kernels.float8 import FP8_DTYPE, dequantize_blockwise, quantize_blockwise
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
    buffer = kernel_buffer(group_name, "cpu", x.shape[-1])
    num_ranks, num_local_experts = buffer.world_size, num_experts // buffer.world_size
    num_tokens, top_k = topk_idx.shape

    # (num_tokens, num_ranks): does the token have at least one expert on that rank?
    valid = topk_idx >= 0
    dst_rank = torch.where(valid, topk_idx // num_local_experts, num_ranks)  # invalid -> overflow column
    is_token_in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool)
    is_token_in_rank.scatter_(1, dst_rank, True)
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()

    # Send order: rank-major, then token order (nonzero on the transpose enumerates (rank, token) that way).
    send_rank, send_token = is_token_in_rank.t().nonzero(as_tuple=True)
    num_send_per_rank = is_token_in_rank.sum(0)
    num_recv_per_rank = torch.empty_like(num_send_per_rank)
    dist.all_to_all_single(num_recv_per_rank, num_send_per_rank, group=buffer.group)
    send_splits, recv_splits = num_send_per_rank.tolist(), num_recv_per_rank.tolist()

    local_idx = topk_idx[send_token] - (send_rank * num_local_experts).unsqueeze(1)
    on_dst = valid[send_token] & (local_idx >= 0) & (local_idx < num_local_experts)
    send_topk_idx = torch.where(on_dst, local_idx, -1)
    send_topk_weights = torch.where(on_dst, topk_weights[send_token], 0.0).to(topk_weights.dtype)

    def exchange(t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((sum(recv_splits), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=buffer.group)
        return out

    if fp8:  # gloo has no FP8 type: the bytes travel as uint8
        x_fp8, x_scales = quantize_blockwise(x)
        recv_fp8 = exchange(x_fp8[send_token].view(torch.uint8)).view(FP8_DTYPE)
        recv_x = dequantize_blockwise(recv_fp8, exchange(x_scales[send_token])).to(x.dtype)
    else:
        recv_x = exchange(x[send_token])
    recv_topk_idx = exchange(send_topk_idx)
    recv_topk_weights = exchange(send_topk_weights)
    recv_src_idx = exchange(send_token)

    if sync_free:
        num_worst = num_tokens * num_ranks
        if recv_x.shape[0] > num_worst:  # checked after the exchanges, so no other rank is left waiting
            raise RuntimeError(
                f"deepep sync-free dispatch received {recv_x.shape[0]} tokens, more than its worst case {num_tokens} "
                f"local tokens x {num_ranks} ranks: every EP rank must dispatch the same number of tokens"
            )
        recv_x = _pad(recv_x, num_worst, float("nan"))
        recv_topk_weights = _pad(recv_topk_weights, num_worst, float("nan"))
        recv_topk_idx, recv_src_idx = _pad(recv_topk_idx, num_worst, -1), _pad(recv_src_idx, num_worst, -1)
    masked = recv_topk_idx.reshape(-1)
    num_recv_tokens_per_expert = torch.bincount(masked[masked >= 0], minlength=num_local_experts)
    slots = expert_major_order(recv_topk_idx, num_local_experts)
    if not sync_free:
        slots = slots[: int(num_recv_tokens_per_expert.sum())].clone()
    handle = [is_token_in_rank, num_recv_per_rank, recv_src_idx]
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, slots, handle


def combine(
    x: torch.Tensor, handle: list[torch.Tensor], group_name: str, topk_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = kernel_buffer(group_name, "cpu", x.shape[-1])
    is_token_in_rank, num_recv_per_rank, _ = handle
    num_tokens = is_token_in_rank.shape[0]
    _, send_token = is_token_in_rank.t().nonzero(as_tuple=True)
    send_splits = is_token_in_rank.sum(0).tolist()
    recv_splits = num_recv_per_rank.tolist()

    def reduce_back(t: torch.Tensor) -> torch.Tensor:
        back = t.new_empty((sum(send_splits), *t.shape[1:]))
        t = t[: sum(recv_splits)]  # sync-free padding rows are not sent
        dist.all_to_all_single(back, t.contiguous(), send_splits, recv_splits, group=buffer.group)
        total = torch.zeros((num_tokens, *t.shape[1:]), dtype=torch.float32)
        return total.index_add_(0, send_token, back.float()).to(t.dtype)

    combined_x = reduce_back(x)
    if topk_weights is None:
        return combined_x, x.new_empty((num_tokens, 0), dtype=torch.float32)
    return combined_x, reduce_back(topk_weights)


def cached_dispatch(x: torch.Tensor, handle: list[torch.Tensor], group_name: str) -> torch.Tensor:
    buffer = kernel_buffer(group_name, "cpu", x.shape[-1])
    is_token_in_rank, num_recv_per_rank, recv_src_idx = handle
    _, send_token = is_token_in_rank.t().nonzero(as_tuple=True)
    send_splits = is_token_in_rank.sum(0).tolist()
    recv_splits = num_recv_per_rank.tolist()
    out = x.new_empty((sum(recv_splits), x.shape[1]))
    dist.all_to_all_single(out, x[send_token].contiguous(), recv_splits, send_splits, group=buffer.group)
    return _pad(out, recv_src_idx.shape[0], float("nan"))  # the dispatch's row count, sync-free padding included


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """t with rows appended up to `rows`, filled with `value`."""
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])
