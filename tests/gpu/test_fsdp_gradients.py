"""FSDP's reduce-scatter buffers come from the default stream's pool, also when allocated under another stream."""

import torch

from torchtitan.distributed.fsdp_gradients import ComputePoolReduceScatter


def _segment_stream(tensor: torch.Tensor) -> int:
    address = tensor.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment["stream"]
    raise AssertionError("tensor not in any segment")


def test_buffers_come_from_the_default_stream_pool():
    comm = ComputePoolReduceScatter()
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = comm.allocate((64 << 20,), dtype=torch.float32, device=device)
        on_side.fill_(1.0)
        plain = torch.empty(64 << 20, device=device)
    on_default = comm.allocate((64 << 20,), dtype=torch.float32, device=device)
    default_id = torch.cuda.default_stream(device).cuda_stream
    assert _segment_stream(on_side) == default_id == _segment_stream(on_default)
    assert _segment_stream(plain) == side.cuda_stream  # what FSDP's default allocation does
    torch.cuda.synchronize()
    assert on_side.sum().item() == 64 << 20
