"""What the dispatch handle (returned by `deepep::dispatch`, consumed by `deepep::combine`) holds: a flat
`list[Tensor]` laid out per kernel (CPU gloo reference, DeepEP intranode or internode). Fake kernels need its shapes;
combine and the cached dispatch need two sizes from it (source tokens, received tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["HandleLayout", "cpu_layout", "internode_layout", "intranode_layout"]

# One entry per handle tensor: (name, shape built from (num_tokens, num_recv, num_rdma_recv), dtype).
_Dim = int | torch.SymInt
_ShapeFn = Callable[[_Dim, _Dim, _Dim], tuple[_Dim, ...]]

# DeepEP constants (csrc/kernels/configs.cuh, internode SourceMeta).
_NUM_MAX_NVL_PEERS = 8
_SOURCE_META_BYTES = 8


@dataclass(frozen=True)
class HandleLayout:
    name: str
    tensors: tuple[tuple[str, _ShapeFn, torch.dtype], ...]
    num_tokens_index: int
    """Handle tensor whose dim 0 is the number of source tokens on this rank."""
    num_recv_index: int
    """Handle tensor whose dim 0 is the number of tokens this rank received."""
    has_rdma_recv: bool = False
    """The handle has a second data-dependent size (tokens received over RDMA, internode only)."""

    def fake_handle(self, num_tokens: _Dim, num_recv: _Dim, device: torch.device) -> list[torch.Tensor]:
        num_rdma_recv = torch.library.get_ctx().new_dynamic_size() if self.has_rdma_recv else 0
        return [
            torch.empty(shape(num_tokens, num_recv, num_rdma_recv), dtype=dtype, device=device)
            for _, shape, dtype in self.tensors
        ]

    def num_tokens(self, handle: Sequence[torch.Tensor]) -> _Dim:
        return handle[self.num_tokens_index].shape[0]

    def num_recv(self, handle: Sequence[torch.Tensor]) -> _Dim:
        return handle[self.num_recv_index].shape[0]


def cpu_layout(num_ranks: int) -> HandleLayout:
    """Gloo reference: enough to replay the exchange in either direction."""
    return HandleLayout(
        name="cpu",
        tensors=(
            ("is_token_in_rank", lambda t, r, rr: (t, num_ranks), torch.bool),
            ("num_recv_tokens_per_rank", lambda t, r, rr: (num_ranks,), torch.int64),
            ("recv_src_idx", lambda t, r, rr: (r,), torch.int64),
        ),
        num_tokens_index=0,
        num_recv_index=2,
    )


def intranode_layout(num_ranks: int, num_sms: int) -> HandleLayout:
    """`deep_ep.Buffer.dispatch` intranode handle, in DeepEP's tuple order."""
    channels = num_sms // 2
    i32 = torch.int32
    return HandleLayout(
        name="intranode",
        tensors=(
            ("rank_prefix_matrix", lambda t, r, rr: (num_ranks, num_ranks), i32),
            ("channel_prefix_matrix", lambda t, r, rr: (num_ranks, channels), i32),
            ("recv_channel_prefix_matrix", lambda t, r, rr: (num_ranks, channels), i32),
            ("recv_src_idx", lambda t, r, rr: (r,), i32),
            ("is_token_in_rank", lambda t, r, rr: (t, num_ranks), torch.bool),
            ("send_head", lambda t, r, rr: (t, num_ranks), i32),
        ),
        num_tokens_index=4,
        num_recv_index=3,
    )


def internode_layout(num_ranks: int, num_rdma_ranks: int, num_sms: int) -> HandleLayout:
    """`deep_ep.Buffer.dispatch` internode handle, in DeepEP's tuple order."""
    channels = num_sms // 2
    i32 = torch.int32
    return HandleLayout(
        name="internode",
        tensors=(
            ("is_token_in_rank", lambda t, r, rr: (t, num_ranks), torch.bool),
            ("rdma_channel_prefix_matrix", lambda t, r, rr: (num_rdma_ranks, channels), i32),
            ("gbl_channel_prefix_matrix", lambda t, r, rr: (num_ranks, channels), i32),
            ("recv_rdma_channel_prefix_matrix", lambda t, r, rr: (num_rdma_ranks, channels), i32),
            ("recv_rdma_rank_prefix_sum", lambda t, r, rr: (num_rdma_ranks,), i32),
            ("recv_gbl_channel_prefix_matrix", lambda t, r, rr: (num_ranks, channels), i32),
            ("recv_gbl_rank_prefix_sum", lambda t, r, rr: (num_ranks,), i32),
            ("recv_src_meta", lambda t, r, rr: (r, _SOURCE_META_BYTES), torch.uint8),
            ("send_rdma_head", lambda t, r, rr: (t, num_rdma_ranks), i32),
            ("send_nvl_head", lambda t, r, rr: (rr, _NUM_MAX_NVL_PEERS), i32),
        ),
        num_tokens_index=0,
        num_recv_index=7,
        has_rdma_recv=True,
    )
