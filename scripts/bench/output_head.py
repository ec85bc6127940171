"""Output head + cross-entropy, forward and backward: the plain head (bf16 logits, then the compiled loss) against
the fused OutputHead at several chunk sizes. Time (CUDA events, median) and the peak memory above the inputs.

    python scripts/bench/output_head.py --rows 16384 --dim 2048 --vocab 102400 --chunk-rows 1024 2048 4096 8192

Writes benchmarks/results/output_head_<rows>x<dim>x<vocab>.json (or $BENCH_OUT).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import cuda_time_ms, write_result  # noqa: E402
from torchtitan.components.loss import cross_entropy_sum  # noqa: E402
from torchtitan.models.output_head import OutputHead, chunk_loss_and_grad  # noqa: E402

GIB = 1024**3


def measure(head: OutputHead, h: torch.Tensor, labels: torch.Tensor, fused: bool, loss_fn) -> dict:
    def step():
        head.weight.grad = None
        h.grad = None
        loss = head(h, labels=labels) if fused else loss_fn(head(h), labels)
        (loss / labels.numel()).backward()

    ms = cuda_time_ms(step, warmup=3, iters=10)
    step()  # with the gradients of the last call alive, as in training
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return {"ms": ms, "peak_above_inputs_gib": (torch.cuda.max_memory_allocated() - base) / GIB}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=102400)
    parser.add_argument("--chunk-rows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()

    torch.manual_seed(0)
    head = OutputHead(args.dim, args.vocab).cuda().bfloat16()
    head.chunk_fn = torch.compile(chunk_loss_and_grad)
    h = torch.randn(1, args.rows, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.rows), device="cuda")
    gemm_tflop = 3 * 2 * args.rows * args.dim * args.vocab / 1e12

    rows = {"plain": measure(head, h, labels, fused=False, loss_fn=torch.compile(cross_entropy_sum))}
    for chunk in args.chunk_rows:
        head.chunk_rows = chunk
        rows[f"fused_chunk{chunk}"] = measure(head, h, labels, fused=True, loss_fn=None)
    for name, row in rows.items():
        row["gemm_tflops"] = gemm_tflop / (row["ms"] / 1e3)
        peak = row["peak_above_inputs_gib"]
        print(f"{name:20s} {row['ms']:7.2f} ms  {row['gemm_tflops']:6.0f} TFLOP/s  peak +{peak:.2f} GiB")
    result = {"rows": args.rows, "dim": args.dim, "vocab": args.vocab, "gemm_tflop": gemm_tflop, "results": rows}
    print(write_result(result, f"output_head_{args.rows}x{args.dim}x{args.vocab}"))


if __name__ == "__main__":
    main()
