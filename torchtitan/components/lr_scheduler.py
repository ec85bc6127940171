"""Warmup-stable-decay learning rate: one LambdaLR per optimizer, all driven by the same factor.

With `s` the 0-based index of the optimizer step about to run (LambdaLR's `last_epoch`), W warmup steps,
S stable steps and D decay steps (W + S + D = training.steps), the lr is `peak_lr * factor(s)`:

    warmup  s < W:        factor = (s + 1) / (W + 1)
    stable  s < W + S:    factor = 1
    decay   otherwise:    p = (s + 1 - W - S) / (D + 1)
                          linear: 1 - p   sqrt: 1 - sqrt(p)   cosine: (1 + cos(pi p)) / 2
                          factor = min_lr_factor + (1 - min_lr_factor) * shape

These are torchtitan's formulas (the +1s keep the first warmup lr above zero and the last decay lr above
`min_lr_factor`). D = round(steps * decay_ratio), or steps - W when decay_ratio is None.
"""

import functools
import logging
import math
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import JobConfig

__all__ = ["LRSchedulersContainer", "build_lr_schedulers"]

logger = logging.getLogger(__name__)


class LRSchedulersContainer:
    """Steps the LambdaLR of every optimizer together; its state is just the shared step count, so a resumed run picks
    up a changed peak lr or schedule from the config."""

    def __init__(self, optimizers: OptimizersContainer, lr_lambda: functools.partial) -> None:
        if len(optimizers) == 0:
            raise ValueError("need at least one optimizer to build an lr scheduler")
        self.lr_lambda = lr_lambda
        self.schedulers = [LambdaLR(optimizer, lr_lambda) for optimizer in optimizers]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        """The lr the next optimizer step will use (first parameter group of the first optimizer)."""
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        last_epoch = int(state_dict["last_epoch"])
        factor = self.lr_lambda(last_epoch)
        for scheduler in self.schedulers:
            scheduler.last_epoch = last_epoch
            # The optimizer's lr follows the schedule (not the lr saved with the optimizer state).
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base_lr * factor
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def build_lr_schedulers(optimizers: OptimizersContainer, job_config: JobConfig) -> LRSchedulersContainer:
    config = job_config.lr_scheduler
    training_steps = job_config.training.steps
    warmup_steps = int(config.warmup_steps)  # the values were checked where they entered (config.manager)
    # A run shorter than its schedule (a smoke test, a benchmark) warms up and decays over what it has, as torchtitan
    # does: what such a run is for, so an info line, not a warning (the step line's lr shows the schedule too); the
    # line names the setting that did not fit, for a run where a full schedule was meant.
    shortened = None
    if warmup_steps > training_steps:
        shortened = (
            f"warming up over all {training_steps} steps, no decay (lr_scheduler.warmup_steps={warmup_steps} is "
            "longer than the run)"
        )
        warmup_steps = training_steps
    if config.decay_ratio is None:
        decay_steps = training_steps - warmup_steps
    else:
        decay_steps = round(training_steps * config.decay_ratio)
        if warmup_steps + decay_steps > training_steps:
            shortened = shortened or (
                f"warmup {warmup_steps}, then decaying over the last {training_steps - warmup_steps} steps (the "
                f"{decay_steps} of lr_scheduler.decay_ratio={config.decay_ratio} do not fit beside the warmup)"
            )
            decay_steps = training_steps - warmup_steps
    if shortened:
        logger.info(f"lr schedule of this {training_steps}-step run: {shortened}")

    lr_lambda = functools.partial(
        warmup_stable_decay_factor,
        warmup_steps=warmup_steps,
        stable_steps=training_steps - warmup_steps - decay_steps,
        decay_steps=decay_steps,
        decay_type=config.decay_type,
        min_lr_factor=config.min_lr_factor,
    )
    return LRSchedulersContainer(optimizers, lr_lambda)


def warmup_stable_decay_factor(
    step: int, *, warmup_steps: int, stable_steps: int, decay_steps: int, decay_type: str, min_lr_factor: float
) -> float:
    """lr multiplier for 0-based optimizer step `step` (see the module docstring)."""
    warmup_stable_steps = warmup_steps + stable_steps
    # The scheduler steps once after the last optimizer step; like torchtitan, clamp there (factor -> min).
    step = min(step, warmup_stable_steps + decay_steps)
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < warmup_stable_steps or decay_steps == 0:
        return 1.0
    progress = (step + 1 - warmup_stable_steps) / (decay_steps + 1)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay_type={decay_type!r}; use linear, sqrt or cosine")
    return min_lr_factor + (1.0 - min_lr_factor) * shape
