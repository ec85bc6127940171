"""Plan a job before running it: memory per GPU by category against the card, the predicted step, tokens/s/GPU and
MFU with the measured rates and stated bandwidths behind them, and the cheapest change when it does not fit.

    python -m torchtitan.plan --job.config_file F --nnodes N --gpus-per-node G --gpu h100|h200 [--section.field v]
"""

from torchtitan.plan.estimate import Plan, plan_job

__all__ = ["Plan", "plan_job"]
