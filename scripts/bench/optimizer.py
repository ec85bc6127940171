"""Optimizer step benchmark: gradient clipping + AdamW over one GPU's local shards of a model, against the memory bound.

    python scripts/bench/optimizer.py --flavor 16B_bench4 --fsdp 2 --ep 2 --out $OUT/opt.json
    python scripts/bench/optimizer.py --flavor debugmodel_tiny --device cpu      # smoke test; CPU times mean little

The local parameter shapes are those one rank holds under FSDP2 x EP (parallelize.py): dense parameters sharded on
dim 0 over the `fsdp` ranks; routed experts split over `ep` ranks on the expert dim, then over the fsdp/ep ranks on
dim 0 (dim 1 where those ranks outnumber the local experts). They are built as plain fp32 tensors on one device,
with random gradients, and three paths run on them:

    torch_fused    today's trainer: get_total_norm + clip_grads_with_norm_ (clip_grad_norm_), torch AdamW fused
    torch_foreach  the same with torch AdamW foreach
    ours           grad_norm_and_clip_coef (Triton sum of squares) + MultiTensorAdamW with the clip folded in

The bound: a step must read every gradient for the norm (4 B/param) and read param, grad, exp_avg, exp_avg_sq and
write param, exp_avg, exp_avg_sq for the update (28 B/param): 32 B/param over the device's copy bandwidth (measured
here: a large device-to-device copy moves 2 x its bytes) and over the datasheet bandwidth (`--datasheet-bandwidth`).
Times are CUDA-event medians after warm-up; kernel launches are counted by torch.profiler over one step.
"""

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import RESULTS_DIR, time_ms, write_result  # noqa: E402
from torchtitan.components.adamw import MultiTensorAdamW  # noqa: E402
from torchtitan.distributed.utils import grad_norm_and_clip_coef  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, all_flavors  # noqa: E402

BYTES_PER_PARAM = 4 + 28  # norm: read grad; update: read p, g, m, v and write p, m, v (fp32)
MAX_NORM = 1.0  # random N(0, 1) gradients of millions of elements: clipping is always active
LR = 1e-6  # small: parameters stay O(1) over hundreds of timed steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="16B_bench4", choices=sorted(all_flavors()))
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP (dp_shard) degree; EP ranks are carved from it")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides --fsdp)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--datasheet-bandwidth", type=float, default=4.8e12, help="bytes/s; 4.8e12: H200 HBM3e")
    parser.add_argument("--out", type=Path, help="JSON file (default: benchmarks/results/optimizer_<...>.json)")
    args = parser.parse_args()
    if args.fsdp % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide --fsdp {args.fsdp} (EP ranks are carved from the FSDP ranks)")

    device = torch.device(args.device)
    shapes = local_shapes(args.flavor, args.fsdp, args.ep)
    num_params = sum(math.prod(shape) for shape in shapes)
    print(f"{args.flavor} fsdp={args.fsdp} ep={args.ep}: {len(shapes)} tensors, {num_params / 1e9:.3f}B params/rank")
    params = make_params(shapes, device)

    copy_bandwidth = measure_copy_bandwidth(device, args.warmup, args.iters)
    step_bytes = BYTES_PER_PARAM * num_params
    bound_ms = {
        "measured_copy": step_bytes / copy_bandwidth * 1e3,
        "datasheet": step_bytes / args.datasheet_bandwidth * 1e3,
    }
    result = {
        "flavor": args.flavor,
        "fsdp": args.fsdp,
        "ep": args.ep,
        "device_type": device.type,
        "num_tensors": len(shapes),
        "num_params": num_params,
        "bytes_per_step": step_bytes,
        "copy_bandwidth_bytes_per_s": copy_bandwidth,
        "datasheet_bandwidth_bytes_per_s": args.datasheet_bandwidth,
        "bound_ms": bound_ms,
        "paths": {},
    }
    print(
        f"bound: {bound_ms['measured_copy']:.2f} ms at the measured copy bandwidth ({copy_bandwidth / 1e12:.2f} TB/s),"
        f" {bound_ms['datasheet']:.2f} ms at the datasheet's ({args.datasheet_bandwidth / 1e12:.2f} TB/s)"
    )
    for name, build in PATHS.items():
        step = build(params)
        ms = time_ms(step, args.warmup, args.iters, device)
        entry = {
            "ms": ms,
            "ratio_to_measured_bound": ms / bound_ms["measured_copy"],
            "ratio_to_datasheet_bound": ms / bound_ms["datasheet"],
        }
        if device.type == "cuda":
            entry["kernel_launches"], entry["memcpys"] = count_kernels(step)
        result["paths"][name] = entry
        launches = f", {entry['kernel_launches']} kernels" if "kernel_launches" in entry else ""
        print(
            f"{name:>14}: {ms:8.2f} ms  {entry['ratio_to_measured_bound']:.2f}x measured bound, "
            f"{entry['ratio_to_datasheet_bound']:.2f}x datasheet bound{launches}",
            flush=True,
        )
        del step  # and with it this path's optimizer state, before the next path allocates its own
        if device.type == "cuda":
            torch.cuda.empty_cache()

    out = args.out or RESULTS_DIR / f"optimizer_{args.flavor}_fsdp{args.fsdp}_ep{args.ep}.json"
    print(f"wrote {write_result(result, out.stem, out.parent)}")


def local_shapes(flavor: str, fsdp: int, ep: int) -> list[tuple[int, ...]]:
    """The shapes of rank 0's local shards (FSDP2 gives rank 0 the ceil-sized shard of an uneven split)."""
    with torch.device("meta"):
        model = DeepSeekV3Model(all_flavors()[flavor])
    experts_fsdp = fsdp // ep  # dp_shard_mod_ep
    shapes = []
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if ".moe.experts." in name:
            shape[0] //= ep
            shard_dim = 1 if experts_fsdp > shape[0] else 0
            shape[shard_dim] = math.ceil(shape[shard_dim] / experts_fsdp)
        elif shape:
            shape[0] = math.ceil(shape[0] / fsdp)
        shapes.append(tuple(shape))
    return shapes


def make_params(shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.nn.Parameter]:
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device))
        param.grad = torch.randn(shape, device=device)
        params.append(param)
    return params


def torch_step(params: list[torch.nn.Parameter], implementation: str) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **{implementation: True})
    grads = [param.grad for param in params]

    def step() -> None:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=True)
        optimizer.step()

    return step


def ours_step(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    optimizer = MultiTensorAdamW(params, lr=LR, weight_decay=0.1)

    def step() -> None:
        _, clip_coef = grad_norm_and_clip_coef(params, MAX_NORM)
        optimizer.step(grad_scale=clip_coef)

    return step


PATHS = {
    "torch_fused": lambda params: torch_step(params, "fused"),
    "torch_foreach": lambda params: torch_step(params, "foreach"),
    "ours": ours_step,
}


def measure_copy_bandwidth(device: torch.device, warmup: int, iters: int) -> float:
    """Bytes/s of a large device-to-device copy, counting its read and its write."""
    num_bytes = 4 << 30 if device.type == "cuda" else 64 << 20
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters, device)
    return 2 * num_bytes / (ms / 1e3)


def count_kernels(step: Callable[[], None]) -> tuple[int, int]:
    """(kernel launches, memory copies/sets) on the GPU during one call of `step`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
    memcpys = sum(name.startswith(("Memcpy", "Memset")) for name in names)
    return len(names) - memcpys, memcpys


if __name__ == "__main__":
    main()
