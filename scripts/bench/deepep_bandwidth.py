"""DeepEP intranode dispatch/combine bandwidth through our `torch.ops.deepep` ops.

    torchrun --nproc-per-node 8 scripts/bench/deepep_bandwidth.py

Same workload and formula as DeepEP's own intranode test, so the numbers compare with its published NVLink figure:
4096 tokens x hidden 7168 in bf16 per rank, top-8 of 256 experts chosen at random;
    dispatch GB/s = recv_x bytes on this rank (num_recv_tokens * hidden * 2) / dispatch time
    combine  GB/s = the same bytes (sent back) / combine time
reported as the minimum over ranks of the median over iterations. `--fp8` also times the FP8 dispatch
(`--deepep.float8_dispatch`: e4m3 values plus one fp32 scale per 128 channels, quantization and dequantization
included), reported against the same bf16 bytes so the two rates compare as speeds.

`--sweep` also times every NVL send-chunk size DeepEP's own tuning tries (dispatch 4-32 tokens, combine 1-16, the
receive buffer kept at the config's), since DeepEP's configs were tuned for 20-24 SMs and the trainer uses 64. The
16B model's exchange is `--num-tokens 16384 --hidden 2048 --num-experts 64 --top-k 6`.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import cuda_time_ms, init_nccl_from_torchrun, write_result  # noqa: E402
from torchtitan.distributed.deepep.buffer import EPBuffer, get_or_create_buffer  # noqa: E402  (defines torch.ops.deepep)
from torchtitan.distributed.group_buffers import release_group_buffers  # noqa: E402
from torchtitan.distributed.utils import destroy_process_groups  # noqa: E402
from torchtitan.models.moe.exchange import DeepEPBackend  # noqa: E402

TRAINER_NUM_SMS = DeepEPBackend().num_sms  # the trainer's default DeepEP SM count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=TRAINER_NUM_SMS)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--fp8", action="store_true", help="also time the FP8 dispatch")
    parser.add_argument("--sweep", action="store_true", help="also time DeepEP's NVL send-chunk sizes")
    args = parser.parse_args()

    device = init_nccl_from_torchrun()
    group = dist.group.WORLD
    ep = dist.get_world_size()
    buffer = get_or_create_buffer(group, args.hidden, device_type="cuda", num_sms=args.num_sms)
    group_name = group.group_name

    torch.manual_seed(dist.get_rank())
    x = torch.randn(args.num_tokens, args.hidden, device=device, dtype=torch.bfloat16)
    scores = torch.rand(args.num_tokens, args.num_experts, device=device)
    topk_weights, topk_idx = scores.topk(args.top_k, dim=-1)
    with torch.no_grad():
        recv_x, _, _, _, _, handle = torch.ops.deepep.dispatch(
            x, topk_idx, topk_weights, args.num_experts, group_name, False, False
        )
        dispatch_ms = cuda_time_ms(
            lambda: torch.ops.deepep.dispatch(x, topk_idx, topk_weights, args.num_experts, group_name, False, False),
            5,
            args.iters,
            barrier=True,
        )
        combine_ms = cuda_time_ms(
            lambda: torch.ops.deepep.combine(recv_x, handle, group_name, None), 5, args.iters, barrier=True
        )
        fp8_ms = float("nan")
        if args.fp8:
            fp8_ms = cuda_time_ms(
                lambda: torch.ops.deepep.dispatch(x, topk_idx, topk_weights, args.num_experts, group_name, False, True),
                5,
                args.iters,
                barrier=True,
            )
        sweep = chunk_sweep(buffer, x, topk_idx, topk_weights, recv_x, handle, args) if args.sweep else {}
    recv_bytes = recv_x.numel() * recv_x.element_size()
    times = (dispatch_ms, combine_ms, fp8_ms)
    rates = torch.tensor([recv_bytes / 1e6 / ms for ms in times], device=device)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        result = dict(
            ep=ep,
            num_tokens=args.num_tokens,
            hidden=args.hidden,
            num_experts=args.num_experts,
            top_k=args.top_k,
            num_sms=args.num_sms,
            dispatch_ms=dispatch_ms,
            combine_ms=combine_ms,
            dispatch_gbps=rates[0].item(),
            combine_gbps=rates[1].item(),
            **({"fp8_dispatch_ms": fp8_ms, "fp8_dispatch_bf16_equivalent_gbps": rates[2].item()} if args.fp8 else {}),
            **sweep,
            formula="recv_x bytes (num_recv_tokens*hidden*2, bf16) / time; min over ranks of the median",
        )
        write_result(result, f"deepep_bandwidth_ep{ep}" + ("_fp8" if args.fp8 else ""))
        print(f"ep={ep}: dispatch {rates[0].item():.1f} GB/s, combine {rates[1].item():.1f} GB/s", flush=True)


def chunk_sweep(buffer: EPBuffer, x, topk_idx, topk_weights, recv_x, handle, args) -> dict:
    """Median ms of dispatch and combine at each NVL send-chunk size (receive buffer 256 tokens, as in every DeepEP
    intranode config), max over ranks; the buffer's own configs (timed above) are put back."""
    deep_ep, group_name = buffer.deep_ep, buffer.group_name
    default_dispatch, default_combine = buffer.dispatch_config, buffer.combine_config

    def slowest_rank_ms(fn) -> float:
        t = torch.tensor([cuda_time_ms(fn, 3, args.iters, barrier=True)], device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    dispatch, combine = {}, {}
    for chunk in range(4, 33, 2):
        buffer.dispatch_config = deep_ep.Config(args.num_sms, chunk, 256)
        dispatch[chunk] = slowest_rank_ms(
            lambda: torch.ops.deepep.dispatch(x, topk_idx, topk_weights, args.num_experts, group_name, False, False)
        )
    buffer.dispatch_config = default_dispatch
    for chunk in range(1, 17):
        buffer.combine_config = deep_ep.Config(args.num_sms, chunk, 256)
        combine[chunk] = slowest_rank_ms(lambda: torch.ops.deepep.combine(recv_x, handle, group_name, None))
    buffer.combine_config = default_combine
    return dict(
        sweep_dispatch_ms=dispatch,
        sweep_combine_ms=combine,
        best_dispatch_chunk=min(dispatch, key=dispatch.get),
        best_combine_chunk=min(combine, key=combine.get),
    )


if __name__ == "__main__":
    main()
    release_group_buffers()  # collective on CUDA: before the groups go
    destroy_process_groups()
