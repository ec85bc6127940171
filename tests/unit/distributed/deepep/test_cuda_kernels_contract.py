"""`cuda_kernels` (our side of `deep_ep.Buffer`) against DeepEP's calling contract, on CPU, through a one-rank
stand-in for the runtime (rank 0 of two).

DeepEP runs its kernels on its own stream, which waits for the compute stream's `previous_event` and for nothing
queued after it. A tensor DeepEP reads that was written after the capture is read before it is written: on GPUs
FP8 dispatch quantized the tokens after the capture and trained to NaN at step 2. CPU kernels have no streams, so
the stand-in orders every tensor write (a dispatch mode stamps each op's outputs) and fails a read of anything
stamped after the event. It also checks the FP8 wire layout DeepEP takes (e4m3 values, fp32 (T, H / 128)
scales) and fills the sync-free padding rows the way uninitialised memory may (NaN), as DeepEP leaves them.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.distributed.deepep import buffer as buffer_registry
from torchtitan.distributed.deepep import cuda_kernels
from torchtitan.distributed.deepep.handle_layout import intranode_layout
from torchtitan.distributed.group_buffers import keep_group_buffers, release_group_buffers
from torchtitan.kernels.float8 import FP8_DTYPE, WIRE_BLOCK, dequantize_blockwise, quantize_blockwise

GROUP, NUM_SMS, WORLD_SIZE, NUM_EXPERTS, TOP_K, HIDDEN = "stand-in", 24, 2, 4, 2, 256
LOCAL_EXPERTS = NUM_EXPERTS // WORLD_SIZE


class _WriteOrder(TorchDispatchMode):
    """The compute stream as one sequence: each storage's last write gets the op's sequence number."""

    def __init__(self):
        super().__init__()
        self.clock = 0
        self.last_write: dict[int, int] = {}
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            self.clock += 1
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.last_write[t.untyped_storage().data_ptr()] = self.clock
        return out

    @contextlib.contextmanager
    def comm_stream(self):
        """What DeepEP writes on its own stream is not compute-stream work."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def written_after(self, t: torch.Tensor, clock: int) -> bool:
        return self.last_write.get(t.untyped_storage().data_ptr(), 0) > clock


class _RankZeroRuntime:
    """`deep_ep.Buffer` as rank 0 of two whose peer sends nothing: it receives, in order, its own tokens that chose
    one of its experts. DeepEP's argument checks and stream waits; the peer's part of combine is zero."""

    def __init__(self, order: _WriteOrder):
        self.order = order

    def capture(self):
        return SimpleNamespace(clock=self.order.clock, current_stream_wait=lambda: None)

    def _reads(self, event, **tensors):
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and self.order.written_after(t, event.clock):
                raise AssertionError(f"DeepEP reads {name} written on the compute stream after previous_event")

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
        self._reads(previous_event, topk_idx=topk_idx)
        with self.order.comm_stream():
            rank_of = torch.where(topk_idx >= 0, topk_idx // LOCAL_EXPERTS, WORLD_SIZE)
            in_rank = torch.stack([(rank_of == r).any(1) for r in range(WORLD_SIZE)], dim=1)
            per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
            return in_rank.sum(0).int(), None, per_expert, in_rank, previous_event

    def dispatch(
        self,
        x,
        handle=None,
        is_token_in_rank=None,
        topk_idx=None,
        topk_weights=None,
        num_worst_tokens=0,
        previous_event=None,
        **kwargs,
    ):
        values, scales = x if isinstance(x, tuple) else (x, None)
        self._reads(previous_event, x=values, x_scales=scales, topk_idx=topk_idx, topk_weights=topk_weights)
        for i, t in enumerate(handle or ()):
            self._reads(previous_event, **{f"handle[{i}]": t})
        assert values.dim() == 2 and values.is_contiguous() and values.shape[1] * values.element_size() % 16 == 0
        if scales is None:
            assert values.dtype == torch.bfloat16, "DeepEP's bf16 kernels got another dtype"
        else:
            assert values.dtype == FP8_DTYPE
            assert scales.dtype == torch.float32 and scales.shape == (values.shape[0], values.shape[1] // WIRE_BLOCK)
        with self.order.comm_stream():
            if handle is not None:  # cached: replay the layout
                received = handle[3][handle[3] >= 0].long()
                return values[received].clone(), None, None, None, None, previous_event
            received = is_token_in_rank[:, 0].nonzero().squeeze(1)
            num_recv = num_worst_tokens or received.numel()

            def padded(t, fill):  # received rows; DeepEP leaves the worst-case padding rows as allocated (NaN here)
                out = torch.full((num_recv, *t.shape[1:]), fill, dtype=t.dtype)
                out[: received.numel()] = t[received]
                return out

            nan = float("nan")
            recv = padded(values, nan) if scales is None else (padded(values, nan), padded(scales, nan))
            local_idx = torch.where((topk_idx >= 0) & (topk_idx < LOCAL_EXPERTS), topk_idx, -1)
            recv_topk_idx = padded(local_idx, -1)
            recv_topk_weights = padded(torch.where(local_idx >= 0, topk_weights, 0.0), 0.0)
            counts = torch.bincount(local_idx[local_idx >= 0], minlength=LOCAL_EXPERTS).tolist()
            channels = NUM_SMS // 2
            new_handle = (
                torch.zeros(WORLD_SIZE, WORLD_SIZE, dtype=torch.int32),
                torch.zeros(WORLD_SIZE, channels, dtype=torch.int32),
                torch.zeros(WORLD_SIZE, channels, dtype=torch.int32),
                padded(torch.arange(values.shape[0], dtype=torch.int32), -1),  # recv_src_idx
                is_token_in_rank,
                torch.zeros(values.shape[0], WORLD_SIZE, dtype=torch.int32),
            )
            return recv, recv_topk_idx, recv_topk_weights, counts, new_handle, previous_event

    def combine(self, x, handle, topk_weights=None, previous_event=None, **kwargs):
        self._reads(previous_event, x=x, topk_weights=topk_weights)
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        with self.order.comm_stream():
            src = handle[3].long()
            real = src >= 0
            combined = x.new_zeros(handle[4].shape[0], x.shape[1]).index_add_(0, src[real], x[real])
            weights = None
            if topk_weights is not None:
                weights = topk_weights.new_zeros(handle[4].shape[0], topk_weights.shape[1])
                weights.index_add_(0, src[real], topk_weights[real])
            return combined, weights, previous_event


@pytest.fixture
def order():
    order = _WriteOrder()
    runtime = _RankZeroRuntime(order)
    stand_in = buffer_registry.EPBuffer(
        group=None,
        group_name=GROUP,
        world_size=WORLD_SIZE,
        device_type="cuda",
        hidden_dim=HIDDEN,
        num_sms=NUM_SMS,
        layout=intranode_layout(WORLD_SIZE, NUM_SMS),
        runtime=runtime,
        deep_ep=SimpleNamespace(Buffer=SimpleNamespace(capture=runtime.capture)),
    )
    keep_group_buffers("deepep", GROUP, stand_in, free=lambda buffer: None)
    with order:
        yield order
    release_group_buffers("deepep", GROUP)


def _routing(num_tokens: int = 6, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    # two 128-channel blocks 1e3 apart: a scale shared across blocks would flush the small one
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * torch.tensor([1.0, 1e-3]).repeat_interleave(128)).to(dtype)
    topk_idx = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K].contiguous()
    topk_idx[::3, -1] = -1
    return x, topk_idx, torch.rand(num_tokens, TOP_K, generator=gen)


@pytest.mark.parametrize("sync_free", [False, True], ids=["synced", "sync_free"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepep_reads_only_what_was_queued_before_its_event(order, fp8, sync_free, dtype):
    """Dispatch (its FP8 quantization or bf16 cast included), combine and the cached dispatch hand DeepEP only
    tensors written before the event its stream waits for."""
    x, topk_idx, topk_weights = _routing(dtype=dtype)
    recv_x, *_, handle = cuda_kernels.dispatch(x, topk_idx, topk_weights, NUM_EXPERTS, GROUP, sync_free, fp8)
    combined, _ = cuda_kernels.combine(recv_x * 2, handle, GROUP, None)  # inputs fresh from the compute stream
    cuda_kernels.cached_dispatch(combined + 1, handle, GROUP)


@pytest.mark.parametrize("sync_free", [False, True], ids=["synced", "sync_free"])
def test_fp8_dispatch_receives_the_blockwise_round_trip_and_ignores_padding(order, sync_free):
    """The received rows are `dequantize_blockwise(quantize_blockwise(x))` of the sent ones in x's dtype; with
    sync_free the NaN rows DeepEP leaves past them are outside every count and after every real slot."""
    x, topk_idx, topk_weights = _routing(dtype=torch.bfloat16)
    recv_x, recv_idx, _, counts, slots, _ = cuda_kernels.dispatch(
        x, topk_idx, topk_weights, NUM_EXPERTS, GROUP, sync_free, True
    )
    received = ((topk_idx >= 0) & (topk_idx < LOCAL_EXPERTS)).any(1)
    num_recv = int(received.sum())
    assert 0 < num_recv < x.shape[0]
    assert recv_x.dtype == torch.bfloat16
    want = dequantize_blockwise(*quantize_blockwise(x[received])).to(torch.bfloat16)
    assert torch.equal(recv_x[:num_recv], want)
    assert not torch.equal(recv_x[:num_recv], x[received])  # it did go through FP8
    local = topk_idx[(topk_idx >= 0) & (topk_idx < LOCAL_EXPERTS)]
    assert torch.equal(counts, torch.bincount(local, minlength=LOCAL_EXPERTS))
    real_slots = slots[: local.numel()]
    assert (real_slots // TOP_K < num_recv).all() and (recv_idx.reshape(-1)[real_slots] >= 0).all()
    if sync_free:
        assert recv_x.shape[0] == WORLD_SIZE * x.shape[0] and recv_x[num_recv:].isnan().all()
    else:
        assert recv_x.shape[0] == num_recv and slots.numel() == local.numel()
