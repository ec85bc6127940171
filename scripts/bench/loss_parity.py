"""Compare the loss curves of two end-to-end results (e.g. standard vs deepep, same seed and data).

    python scripts/bench/loss_parity.py --name ep4_standard_vs_deepep e2e_a.json e2e_b.json

Writes parity_<name>.json with both curves and the max absolute / relative step-wise difference.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import RESULTS_DIR, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args()
    runs = [json.loads((Path(p) if Path(p).exists() else RESULTS_DIR / p).read_text()) for p in (args.a, args.b)]
    losses_a, losses_b = runs[0]["losses"], runs[1]["losses"]
    if len(losses_a) != len(losses_b):
        sys.exit(f"different step counts: {len(losses_a)} vs {len(losses_b)}")
    diffs = [abs(x - y) for x, y in zip(losses_a, losses_b, strict=True)]
    result = dict(
        name=args.name,
        runs=[r["name"] for r in runs],
        commands=[r["command"] for r in runs],
        steps=len(diffs),
        max_abs_diff=max(diffs),
        max_rel_diff=max(d / abs(y) for d, y in zip(diffs, losses_b, strict=True)),
        losses_a=losses_a,
        losses_b=losses_b,
    )
    write_result(result, f"parity_{args.name}")
    print(
        f"{args.name}: {len(diffs)} steps, max |loss diff| {result['max_abs_diff']:.3e} "
        f"(rel {result['max_rel_diff']:.2e}); first {losses_a[0]:.4f}/{losses_b[0]:.4f}, "
        f"last {losses_a[-1]:.4f}/{losses_b[-1]:.4f}"
    )


if __name__ == "__main__":
    main()
