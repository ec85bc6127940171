"""Context parallelism: every sequence is split over the CP ranks; attention gathers MLA's latent, not K and V.

Split (load-balanced for causal attention, "zigzag"): a sequence of S tokens is cut into 2N chunks over N ranks and
rank r holds chunks r and 2N-1-r, so every rank's queries see the same number of causal keys. Everything but
attention is token-local and runs on the rank's S / N tokens.

What crosses ranks: MLA derives every token's keys and values from a latent of kv_lora_rank + qk_rope_head_dim
values (c_kv after kv_norm, k_pe after RoPE: 576 for DeepSeek-V3), through wkv_b. Each attention layer all-gathers
that latent (`gather_sequence`; its backward reduce-scatters the gradient) and runs wkv_b on the whole sequence:
576 values per token move instead of n_heads x (qk_head_dim + v_head_dim) (5,120 for the 16B shape).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ContextParallel"]


class ContextParallel:
    """One CP group: which positions of a sequence this rank holds, and the all-gather of a per-token tensor."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.degree = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group_name = mesh.get_group().group_name  # a string: traced by torch.compile as a constant

    def positions(self, seqlen: int, device: torch.device) -> torch.Tensor:
        """(seqlen // degree,) int64: the global positions of this rank's tokens of a seqlen-token sequence, in the
        order this rank holds them (chunk rank, then chunk 2 x degree - 1 - rank)."""
        chunk = seqlen // (2 * self.degree)
        first_positions = torch.tensor([self.rank, 2 * self.degree - 1 - self.rank], device=device) * chunk
        return (first_positions[:, None] + torch.arange(chunk, device=device)).flatten()

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """x: (bs, seqlen // degree, d) at this rank's `positions` -> (bs, seqlen, d) of every rank, in sequence
        order. Autograd: the gradient is reduce-scattered back to the ranks that hold the positions."""
        bs, local_len, d = x.shape
        gathered = _AllGather.apply(x.contiguous(), self.group_name, self.degree)  # (degree * bs, local_len, d)
        # rank-major: (degree, bs, [first chunk, second chunk], chunk, d)
        first, second = gathered.view(self.degree, bs, 2, local_len // 2, d).unbind(2)
        # chunk j < degree is rank j's first chunk; chunk 2 x degree - 1 - r is rank r's second chunk
        chunks = torch.cat([first, second.flip(0)])  # (2 x degree, bs, chunk, d) in sequence order
        return chunks.movedim(0, 1).reshape(bs, self.degree * local_len, d)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward reduce-scatters (sum), as functional collectives (traceable)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
        ctx.group_name, ctx.degree = group_name, degree
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(x, degree, group_name)
        return torch.ops._c10d_functional.wait_tensor(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        scattered = torch.ops._c10d_functional.reduce_scatter_tensor(
            grad.contiguous(), "sum", ctx.degree, ctx.group_name
        )
        return torch.ops._c10d_functional.wait_tensor(scattered), None, None
