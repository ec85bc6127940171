"""FP8 dense linears (`--quantize.float8_linears`) against bf16 on one GPU: each linear of a DeepSeek-V3 block
(attention projections, shared-expert and dense FFN), forward and forward+backward, compiled, quantization included.

    python scripts/bench/linear.py --model 16B --tokens 16384

Also times the one-group `torch._scaled_grouped_mm` against `torch._scaled_mm` (what `float8_linear` uses) on the
same quantized operands, the reason for the dense-GEMM special case in float8.py.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import cuda_time_ms, write_result  # noqa: E402
from torchtitan.kernels.float8 import float8_linear, quantize_rowwise  # noqa: E402
from torchtitan.models.deepseek_v3 import all_flavors  # noqa: E402


def block_linears(flavor: str) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of the linears `quantize.float8_linears` converts in one block."""
    a = all_flavors()[flavor]
    shared_hidden = a.moe_inter_dim * a.moe_args.num_shared_experts
    heads_qk = a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
    shapes = {"wkv_a": (a.dim, a.kv_lora_rank + a.qk_rope_head_dim)}
    shapes |= {"wkv_b": (a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim))}
    shapes |= {"wo": (a.n_heads * a.v_head_dim, a.dim)}
    if a.q_lora_rank:
        shapes |= {"wq_a": (a.dim, a.q_lora_rank), "wq_b": (a.q_lora_rank, heads_qk)}
    else:
        shapes |= {"wq": (a.dim, heads_qk)}
    shapes |= {"shared_w1": (a.dim, shared_hidden), "shared_w2": (shared_hidden, a.dim)}
    shapes |= {"dense_w1": (a.dim, a.inter_dim), "dense_w2": (a.inter_dim, a.dim)}
    return shapes


def time_linear(k: int, n: int, tokens: int, bf16, fp8) -> dict:
    """Milliseconds of one (tokens, k) x (k, n) linear in bf16 and FP8, and of its bare forward GEMMs."""
    device = torch.device("cuda")
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    row = {"in": k, "out": n}
    for label, fn in (("bf16", bf16), ("fp8", fp8)):
        row[f"{label}_fwd_ms"] = cuda_time_ms(lambda fn=fn: fn(x, w), warmup=5, iters=20)
        row[f"{label}_fwd_bwd_ms"] = cuda_time_ms(lambda fn=fn: fn(x, w).backward(grad), warmup=5, iters=20)
    (x_q, x_scale), (w_q, w_scale) = quantize_rowwise(x.detach()), quantize_rowwise(w.detach())
    offsets = torch.tensor([tokens], device=device, dtype=torch.int32)
    bare = {
        "gemm_bf16_ms": lambda: x.detach() @ w.detach().t(),
        "gemm_scaled_mm_ms": lambda: torch._scaled_mm(
            x_q, w_q.t(), x_scale[:, None], w_scale[None], out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "gemm_scaled_grouped_mm_ms": lambda: torch._scaled_grouped_mm(
            x_q, w_q.t()[None], x_scale, w_scale[None], offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
    }
    row |= {key: cuda_time_ms(fn, warmup=5, iters=20) for key, fn in bare.items()}
    row["speedup_fwd_bwd"] = row["bf16_fwd_bwd_ms"] / row["fp8_fwd_bwd_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="16B", choices=sorted(all_flavors()))
    parser.add_argument("--tokens", type=int, default=16384, help="rows of each linear's input (batch x seq_len)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16, fp8 = torch.compile(F.linear), torch.compile(float8_linear)
    results = {}
    for name, (k, n) in block_linears(args.model).items():
        results[name] = time_linear(k, n, args.tokens, bf16, fp8)
        print(name, {key: round(value, 3) for key, value in results[name].items()}, flush=True)
    totals = {key: sum(r[key] for r in results.values()) for key in ("bf16_fwd_bwd_ms", "fp8_fwd_bwd_ms")}
    totals["speedup_fwd_bwd"] = totals["bf16_fwd_bwd_ms"] / totals["fp8_fwd_bwd_ms"]
    print("total", totals)
    write_result(
        {"model": args.model, "tokens": args.tokens, "linears": results, "total": totals},
        f"linear_{args.model}_t{args.tokens}",
    )


if __name__ == "__main__":
    main()
