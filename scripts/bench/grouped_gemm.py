"""What the routed experts can reach on one GPU: the grouped-GEMM SwiGLU of one EP rank, alone.

    python scripts/bench/grouped_gemm.py --layer 671b --ep 4 --tokens 8192

With balanced routing each EP rank computes tokens * top_k token copies spread evenly over its E / ep experts.
Times (CUDA events, median) and achieved TFLOP/s for: the three bare `torch._grouped_mm` calls, and
`run_experts_grouped_mm` (the SwiGLU on the experts' padded rows) eager and compiled, forward and forward+backward,
in bf16 and in FP8 (`--quantize.float8_experts`: rowwise-scaled `torch._scaled_grouped_mm`, quantization included).
This separates the GEMM rate from everything else in the MoE layer benchmark (routing, permutation, DeepEP).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import cuda_time_ms, profile_summary, write_result  # noqa: E402
from scripts.bench.moe_layer import LAYERS  # noqa: E402
from torchtitan.kernels.permute import plan_permutation  # noqa: E402
from torchtitan.models.moe.experts import run_experts_grouped_mm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", choices=sorted(LAYERS), required=True)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    layer = LAYERS[args.layer]
    dim, hidden = layer["dim"], layer["moe_inter"]
    local_experts = layer["num_experts"] // args.ep
    rows = args.tokens * layer["top_k"]
    device = torch.device("cuda")
    torch.manual_seed(0)

    def param(*shape):
        return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()

    w1, w3, w2 = param(local_experts, hidden, dim), param(local_experts, hidden, dim), param(local_experts, dim, hidden)
    x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    counts = torch.full((local_experts,), rows // local_experts, device=device, dtype=torch.int64)
    offsets = counts.cumsum(0).to(torch.int32)
    # the experts' input as the dispatchers lay it out: groups padded to 16 rows (bf16 and FP8 alike)
    plan = plan_permutation(torch.arange(rows, device=device), rows, counts, 16)
    padded_x = torch.zeros(plan.padded_slot.shape[0], dim, device=device, dtype=torch.bfloat16)
    padded_x[plan.slot_row] = x.detach()
    padded_x.requires_grad_()
    padded_grad = torch.randn_like(padded_x)
    group_ends = plan.group_ends

    def bare(x=x):
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    compiled = torch.compile(run_experts_grouped_mm, fullgraph=True)
    variants = {
        "bare_grouped_mm": bare,
        "experts_eager": lambda: run_experts_grouped_mm(padded_x, group_ends, w1, w2, w3),
        "experts_compiled": lambda: compiled(padded_x, group_ends, w1, w2, w3),
        "experts_fp8_eager": lambda: run_experts_grouped_mm(padded_x, group_ends, w1, w2, w3, True),
        "experts_fp8_compiled": lambda: compiled(padded_x, group_ends, w1, w2, w3, True),
    }
    fwd_flops = 2 * 3 * dim * hidden * rows
    result = dict(
        layer=args.layer,
        ep=args.ep,
        tokens_per_rank=args.tokens,
        local_experts=local_experts,
        rows=rows,
        dim=dim,
        moe_inter=hidden,
        fwd_tflop=fwd_flops / 1e12,
    )
    for name, fn in variants.items():

        def fwd(fn=fn):
            with torch.no_grad():
                fn()

        def fwd_bwd(fn=fn):
            for t in (x, padded_x, w1, w2, w3):
                t.grad = None  # as after zero_grad(set_to_none=True): no gradient accumulation adds
            out = fn()
            out.backward(grad if out.shape == grad.shape else padded_grad)

        fwd_ms = cuda_time_ms(fwd, 5, 20)
        fwd_bwd_ms = cuda_time_ms(fwd_bwd, 5, 20)
        result[name] = dict(
            fwd_ms=fwd_ms,
            fwd_bwd_ms=fwd_bwd_ms,
            fwd_tflops=fwd_flops / fwd_ms / 1e9,
            fwd_bwd_tflops=3 * fwd_flops / fwd_bwd_ms / 1e9,
        )
        if args.profile:
            result[name]["profile_fwd_bwd"] = profile_summary(fwd_bwd, top=12)
        print(
            f"{args.layer} ep={args.ep} {name}: fwd {fwd_ms:.2f} ms ({result[name]['fwd_tflops']:.0f} TFLOP/s), "
            f"fwd+bwd {fwd_bwd_ms:.2f} ms ({result[name]['fwd_bwd_tflops']:.0f} TFLOP/s)",
            flush=True,
        )
    for phase in ("fwd_ms", "fwd_bwd_ms"):
        result[f"fp8_speedup_{phase[:-3]}"] = result["experts_compiled"][phase] / result["experts_fp8_compiled"][phase]
    print(
        f"fp8 compiled vs bf16 compiled: fwd {result['fp8_speedup_fwd']:.2f}x, "
        f"fwd+bwd {result['fp8_speedup_fwd_bwd']:.2f}x",
        flush=True,
    )
    result["gemms"] = gemm_times(rows, dim, hidden, local_experts, offsets)
    write_result(result, f"grouped_gemm_{args.layer}_ep{args.ep}_t{args.tokens}")


def gemm_times(rows: int, dim: int, hidden: int, experts: int, offsets: torch.Tensor) -> dict:
    """Each GEMM of the experts' forward + backward alone, bf16 vs FP8 on operands quantized beforehand (FP8 with
    and without fast accumulation), ms: where FP8 gains and where it does not, apart from the quantization."""
    device = offsets.device

    def operand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    def fp8(*shape):
        return operand(*shape).to(torch.float8_e4m3fn)

    def ones(*shape):
        return torch.ones(*shape, device=device)

    def against_weights(in_dim, out_dim):
        """(bf16, FP8) arguments of rows (M, in_dim) @ per-expert (E, out_dim, in_dim) transposed."""
        bf16 = (operand(rows, in_dim), operand(experts, out_dim, in_dim).transpose(-2, -1))
        weights_fp8 = fp8(experts, out_dim, in_dim).transpose(-2, -1)
        scaled = (fp8(rows, in_dim), weights_fp8, ones(rows), ones(experts, out_dim))
        return bf16, scaled

    times = {}
    for weight, (n, k) in {"w1_w3": (hidden, dim), "w2": (dim, hidden)}.items():
        gemms = {
            "fwd": against_weights(k, n),  # x (M, K) @ W_e^T -> (M, N)
            # dout (M, N) @ W_e -> (M, K): W_e^T stored (K, N) row-major, i.e. W_e column-major
            "dgrad": against_weights(n, k),
            # dout_e^T (N, M_e) @ x_e (M_e, K) -> (E, N, K), grouped along M
            "wgrad": (
                (operand(n, rows), operand(k, rows).t()),
                (fp8(n, rows), fp8(k, rows).t(), ones(experts * n), ones(experts * k)),
            ),
        }
        for kind, (bf16_args, fp8_args) in gemms.items():
            flops = 2 * rows * n * k
            entry = {"bf16_ms": cuda_time_ms(lambda a=bf16_args: torch._grouped_mm(*a, offs=offsets), 5, 20)}
            for fast in (False, True):
                entry[f"fp8{'_fast_accum' if fast else ''}_ms"] = cuda_time_ms(
                    lambda a=fp8_args, fast=fast: torch._scaled_grouped_mm(
                        *a, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=fast
                    ),
                    5,
                    20,
                )
            entry.update({f"{key[:-3]}_tflops": flops / ms / 1e9 for key, ms in list(entry.items())})
            times[f"{weight}_{kind}"] = entry
            print(
                f"gemm {weight} {kind}: " + ", ".join(f"{key} {value:.2f}" for key, value in entry.items()), flush=True
            )
    return times


if __name__ == "__main__":
    main()
