"""Where each (received token, local expert) pair goes in local-expert-major order; shared by the kernels."""

import torch

__all__ = ["expert_major_slots"]


def expert_major_slots(recv_topk_idx: torch.Tensor, num_local_experts: int, num_copies: int) -> torch.Tensor:
    """Flat slots `row * top_k + k` of the non-masked entries of `recv_topk_idx`, sorted by local expert.

    recv_topk_idx: (num_recv, top_k) local expert ids, -1 where the expert lives on another rank.
    num_copies: number of non-masked entries (known on the host inside the kernels).
    Returns (num_copies,) int64. The sort is stable, so within one expert the copies stay rank-major.
    """
    flat = recv_topk_idx.reshape(-1)
    keys = torch.where(flat >= 0, flat, num_local_experts)  # masked entries sort last
    order = torch.argsort(keys, stable=True)
    return order[:num_copies].clone()
