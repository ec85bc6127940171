"""Plot the loss curves of e2e benchmark results against the first one, and say how far apart they end.

    python scripts/bench/loss_curve.py benchmarks/results/e2e_A.json benchmarks/results/e2e_B.json \\
        --out benchmarks/plots/loss_A_vs_B.png

"End": the mean loss of the last --last steps (one step's loss is noisy); the gap is relative to the first run.
Also each run's largest relative gap to the first over windows of --window steps (the mean loss of steps 1-20,
21-40, ...): the check "losses equal within 0.3% in every 20-step window"; and at any one step after --after (the
check "within 0.5% at every step after step 20"). Read both against the reference's own run-to-run gaps
(`e2e_trees.py --repeats`): with the router's own routing, one commit's runs differ too.
"""

import argparse
import json
from pathlib import Path


def end_gaps(runs: dict[str, list[float]], last: int) -> dict[str, dict[str, float]]:
    """run -> its mean loss over the last `last` steps and its gap relative to the first run's."""
    ends = {name: sum(losses[-last:]) / len(losses[-last:]) for name, losses in runs.items()}
    reference = next(iter(ends.values()))
    return {name: {"end_loss": end, "relative_gap": (end - reference) / reference} for name, end in ends.items()}


def window_gaps(runs: dict[str, list[float]], window: int) -> dict[str, float]:
    """run -> its largest |relative gap| to the first run over the windows of `window` steps both runs complete."""
    reference = next(iter(runs.values()))
    gaps = {}
    for name, losses in runs.items():
        steps = min(len(losses), len(reference)) // window * window
        means = [
            (sum(losses[i : i + window]) / window, sum(reference[i : i + window]) / window)
            for i in range(0, steps, window)
        ]
        gaps[name] = max((abs(a - b) / b for a, b in means), default=0.0)
    return gaps


def step_gaps(runs: dict[str, list[float]], after: int) -> dict[str, float]:
    """run -> its largest |relative gap| to the first run at one step after step `after` (1-based steps), over the
    steps both runs have: the check "within 0.5% at every step after step 20"."""
    reference = next(iter(runs.values()))
    return {
        name: max((abs(a - b) / b for a, b in zip(losses[after:], reference[after:], strict=False)), default=0.0)
        for name, losses in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", type=Path, help="e2e result JSONs; the first is the reference")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--last", type=int, default=20, help="steps averaged for the end loss")
    parser.add_argument("--window", type=int, default=20, help="steps per window of the window check")
    parser.add_argument("--after", type=int, default=20, help="the per-step check counts the steps after this one")
    args = parser.parse_args()
    runs = {}
    for path in args.results:
        result = json.loads(path.read_text())
        runs[result["name"]] = result["losses"]
    gaps = end_gaps(runs, args.last)
    windows = window_gaps(runs, args.window)
    steps = step_gaps(runs, args.after)
    for name, gap in gaps.items():
        print(
            f"{name}: {len(runs[name])} steps, end loss {gap['end_loss']:.4f} ({gap['relative_gap']:+.2%}), "
            f"largest gap over {args.window}-step windows {windows[name]:.3%}, at one step after step "
            f"{args.after} {steps[name]:.3%}"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    reference = next(iter(runs.values()))
    for name, losses in runs.items():
        steps = range(1, len(losses) + 1)
        label = f"{name} (end {gaps[name]['end_loss']:.3f}, {gaps[name]['relative_gap']:+.2%})"
        ax.plot(steps, losses, label=label, linewidth=1)
        gap = [(a - b) / b * 100 for a, b in zip(losses, reference, strict=False)]
        diff.plot(steps[: len(gap)], gap, linewidth=1)
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    diff.set_ylabel("vs first run (%)")
    diff.set_xlabel("step")
    for axis in (ax, diff):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
