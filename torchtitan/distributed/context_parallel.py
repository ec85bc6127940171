"""Context parallelism: every sequence is split over the CP ranks; attention gathers MLA's latent, not K and V.

Split ("zigzag", load-balanced for causal attention): S tokens are cut into 2N chunks over N ranks and rank r holds
chunks r and 2N-1-r. Everything but attention is token-local and runs on the rank's S / N tokens. Each attention
layer all-gathers MLA's latent (c_kv after kv_norm, k_pe after RoPE: 576 values per token for DeepSeek-V3;
`gather_sequence`, whose backward reduce-scatters) and runs wkv_b on the whole sequence, instead of moving
n_heads x (qk_head_dim + v_head_dim) values of K and V (5,120 for the 16B shape).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan.distributed.utils import all_gather_tensor, reduce_scatter_tensor

__all__ = ["ContextParallel"]


class ContextParallel:
    """One CP group: which positions of a sequence this rank holds, and the all-gather of a per-token tensor."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.degree = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group_name = mesh.get_group().group_name  # custom ops take a group by its name

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
        gathered = all_gather(x, self.group_name, self.degree)  # (degree * bs, local_len, d)
        # rank-major: (degree, bs, [first chunk, second chunk], chunk, d)
        first, second = gathered.view(self.degree, bs, 2, local_len // 2, d).unbind(2)
        # chunk j < degree is rank j's first chunk; chunk 2 x degree - 1 - r is rank r's second chunk
        chunks = torch.cat([first, second.flip(0)])  # (2 x degree, bs, chunk, d) in sequence order
        return chunks.movedim(0, 1).reshape(bs, self.degree * local_len, d)


# The gather and its gradient are custom ops around the eager collectives (torch.compile keeps them opaque, per-op
# SAC saves the gather by name): the functional all-gather segfaults on gloo with CUDA tensors (torch 2.11), the
# backend of scripts/bench/shared_gpu.py's memory probe.
@torch.library.custom_op("torchtitan::cp_all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    """All-gather along dim 0 over the group named group_name; the backward reduce-scatters (sum)."""
    out = x.new_empty((degree * x.shape[0], *x.shape[1:]))
    all_gather_tensor(out, x.contiguous(), group=_resolve_process_group(group_name))
    return out


@torch.library.custom_op("torchtitan::cp_reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // degree, *x.shape[1:]))
    reduce_scatter_tensor(out, x.contiguous(), group=_resolve_process_group(group_name))
    return out


@all_gather.register_fake
def _(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    return x.new_empty((degree * x.shape[0], *x.shape[1:]))


@reduce_scatter.register_fake
def _(x: torch.Tensor, group_name: str, degree: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] // degree, *x.shape[1:]))


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.group_name, ctx.degree = inputs


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return reduce_scatter(grad, ctx.group_name, ctx.degree), None, None


all_gather.register_autograd(_backward, setup_context=_setup_context)
