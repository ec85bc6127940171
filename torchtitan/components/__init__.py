"""Training components: optimizer, lr schedule, loss, metrics, checkpointing (see docs/design.md)."""

from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.loss import (
    RescaledLoss,
    build_loss_fn,
    check_finite_loss,
    count_valid_tokens,
    cross_entropy_sum,
    rescale_loss,
)
from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from torchtitan.components.metrics import MetricsProcessor, get_peak_flops
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "LRSchedulersContainer",
    "MetricsProcessor",
    "OptimizersContainer",
    "RescaledLoss",
    "build_loss_fn",
    "build_lr_schedulers",
    "build_optimizers",
    "check_finite_loss",
    "count_valid_tokens",
    "cross_entropy_sum",
    "get_peak_flops",
    "rescale_loss",
]
