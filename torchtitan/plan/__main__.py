"""`python -m torchtitan.plan`: print a job's plan (`torchtitan/plan/__init__.py`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.degrees import LayoutError
from torchtitan.plan.estimate import Plan, plan_job
from torchtitan.plan.fixes import Change, fitting_changes
from torchtitan.plan.hardware import GPUS
from torchtitan.plan.report import format_plan
from torchtitan.preflight import check_layout
from torchtitan.tools.cli import run_cli

CHECK_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_check.json"
MEMORY_BOUND, SPEED_BOUND = 0.07, 0.15
"""What tests/unit/plan/test_plan_check.py holds the plan to against every measured run."""


def plan_from_argv(argv: list[str], nnodes: int, gpus_per_node: int, gpu: str) -> Plan:
    """Parse and check a job (the world-size and model-shape checks of preflight) and plan it."""
    job = ConfigManager().parse_args(argv)
    return plan_job(check_layout(job, nnodes * gpus_per_node), gpus_per_node, gpu)


def accuracy_line() -> str:
    """The plan's measured accuracy, from benchmarks/plan_check.json where the repository is at hand."""
    bounds = f"memory within {MEMORY_BOUND:.0%} and tokens/s within {SPEED_BOUND:.0%} of every measured run"
    if not CHECK_FILE.is_file():
        return f"accuracy: tested to {bounds} (benchmarks/plan_check.json)"
    rows = json.loads(CHECK_FILE.read_text())["rows"]
    memory = max(abs(r["memory_gib_predicted"] / r["memory_gib_measured"] - 1) for r in rows)
    speed = [
        abs(r["tokens_per_sec_predicted"] / r["tokens_per_sec_measured"] - 1)
        for r in rows
        if r["tokens_per_sec_measured"]
    ]
    return (
        f"accuracy: against {len(rows)} measured runs (benchmarks/plan_check.json) reserved memory within "
        f"{memory:.1%}, tokens/s within {max(speed):.1%} (tested: {bounds})"
    )


def _nodes_that_fit(err: Exception, nnodes: int, gpus_per_node: int) -> str:
    """'; plan it with --nnodes N' where the degrees do not fill nnodes x gpus_per_node GPUs and N nodes do."""
    if not isinstance(err, LayoutError):
        return ""
    world = err.smallest_world_size(multiple_of=gpus_per_node)
    if world is None or world == nnodes * gpus_per_node:
        return ""
    return f"; plan it with --nnodes {world // gpus_per_node}"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan.plan", description=__doc__)
    parser.add_argument("--nnodes", type=_positive, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=_positive, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu", choices=sorted(GPUS), required=True, help="the GPU the plan is made for")
    args, job_argv = parser.parse_known_args(argv)
    logging.disable(logging.WARNING)  # the model args' notes (e.g. YaRN) are the trainer's to print
    try:
        plan = plan_from_argv(job_argv, args.nnodes, args.gpus_per_node, args.gpu)
        fits = []
        if not plan.fits:

            def replan(change: Change) -> Plan | None:
                try:
                    return plan_from_argv(
                        [*job_argv, *change.flags], args.nnodes + change.nodes, args.gpus_per_node, args.gpu
                    )
                except (ConfigError, ValueError):
                    return None

            fits = fitting_changes(plan, replan)
    except (ConfigError, ValueError, FileNotFoundError) as err:  # the trainer's words: what run_train.sh would print
        print(f"error: {err}{_nodes_that_fit(err, args.nnodes, args.gpus_per_node)}", file=sys.stderr)
        return 2
    print(format_plan(plan, fits, accuracy_line()))
    return 0


if __name__ == "__main__":
    run_cli(main)
