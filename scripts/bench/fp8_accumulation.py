"""How much Hopper's fast FP8 accumulation loses against the precise one, by reduction length.

    python scripts/bench/fp8_accumulation.py

Multiplies the same FP8 operands (unit scales) with `torch._scaled_mm` and the grouped 2D x 2D
`torch._scaled_grouped_mm` (two groups along K, the weight-gradient form), with and without `use_fast_accum`, and
reports the relative Frobenius error against their fp64 product. Two kinds of sums: "random_sign" (randn operands,
as products with a zero-mean weight or per-token gradient contributions) and "all_positive" (|randn|, sums that
all add up: the worst case, where a fast accumulator stops absorbing small addends). float8.py's accumulation
policy rests on these numbers.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import write_result  # noqa: E402

ROWS = 256


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def errors(k: int, kind: str) -> dict:
    a, b = torch.randn(ROWS, k, device="cuda"), torch.randn(ROWS, k, device="cuda")
    if kind == "all_positive":
        a, b = a.abs(), b.abs()
    a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    half = k // 2
    dense_ref = a.double() @ b.double().t()
    grouped_ref = torch.stack([a[:, g].double() @ b[:, g].double().t() for g in (slice(0, half), slice(half, k))])
    ones_a, ones_b = torch.ones(ROWS, 1, device="cuda"), torch.ones(1, ROWS, device="cuda")
    ends = torch.tensor([half, k], device="cuda", dtype=torch.int32)
    group_ones = torch.ones(2 * ROWS, device="cuda")
    result = {}
    for fast in (False, True):
        dense = torch._scaled_mm(a, b.t(), ones_a, ones_b, out_dtype=torch.bfloat16, use_fast_accum=fast)
        grouped = torch._scaled_grouped_mm(
            a, b.t(), group_ones, group_ones, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
        name = "fast" if fast else "precise"
        result[f"{name}_dense"] = relative_error(dense, dense_ref)
        result[f"{name}_grouped"] = relative_error(grouped, grouped_ref)
    result["bf16_matmul"] = relative_error(a.bfloat16() @ b.bfloat16().t(), dense_ref)
    return result


def main() -> None:
    torch.manual_seed(0)
    table = {}
    for k in (512, 2048, 8192, 32768):
        for kind in ("random_sign", "all_positive"):
            table[f"K{k}_{kind}"] = row = errors(k, kind)
            print(f"K={k:6d} {kind:12s} " + ", ".join(f"{key} {value:.1e}" for key, value in row.items()), flush=True)
    write_result({"rows": ROWS, "relative_error": table}, "fp8_accumulation")


if __name__ == "__main__":
    main()
