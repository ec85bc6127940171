"""One optimizer per model part (pipeline stage), behind a container the trainer steps once: torch.optim's, or for
AdamW `MultiTensorAdamW` (adamw.py). Weight decay applies to every parameter (norms, embeddings too), as torchtitan.

The container's state dict is the *flattened* optimizer state dict of `torch.distributed.checkpoint.state_dict`:
keys are parameter FQNs (`state.layers.0.wq.weight.exp_avg`), values DTensors where the parameters are sharded, so
pipeline stages never collide and DCP can reshard into another layout. torch.optim.AdamW and MultiTensorAdamW save
the same keys.
"""

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.utils.hooks import RemovableHandle

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = ["OptimizersContainer", "build_optimizers", "updates_master_weights"]

StepHook = Callable[["OptimizersContainer", tuple, dict], None]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """Steps, zeroes, saves and loads the optimizers of all model parts as one.

    `register_step_pre_hook` hooks run once per `step()`, before any optimizer steps, with this container as the
    optimizer argument; not forwarded to the per-part optimizers, where a whole-model hook would run once per part and
    inside DCP's optimizer-state initialisation.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        if len(model_parts) != len(optimizers):
            raise ValueError(f"got {len(model_parts)} model parts but {len(optimizers)} optimizers")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self._step_pre_hooks: OrderedDict[int, StepHook] = OrderedDict()

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def register_step_pre_hook(self, hook: StepHook) -> RemovableHandle:
        """Run `hook(container, args, kwargs)` before every `step()`; `.remove()` the handle to drop it."""
        handle = RemovableHandle(self._step_pre_hooks)
        self._step_pre_hooks[handle.id] = hook
        return handle

    @property
    def folds_grad_scale(self) -> bool:
        """Whether every optimizer takes `step(grad_scale=...)`: gradient clipping folded into the update."""
        return all(getattr(optimizer, "folds_grad_scale", False) for optimizer in self.optimizers)

    @torch.no_grad()
    def step(self, *args: Any, grad_scale: torch.Tensor | None = None, **kwargs: Any) -> None:
        """Step every optimizer; `grad_scale` (the clip coefficient, a 0-dim tensor) multiplies the gradients inside
        the update and needs `folds_grad_scale`."""
        if grad_scale is not None:
            if not self.folds_grad_scale:
                raise ValueError(
                    f"step(grad_scale=...) needs optimizers that fold it, got {[type(o).__name__ for o in self]}: "
                    "clip the gradients with clip_grad_norm_ and call step() without it"
                )
            kwargs["grad_scale"] = grad_scale
        for hook in list(self._step_pre_hooks.values()):
            hook(self, args, kwargs)
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for model_part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            state.update(get_optimizer_state_dict(model_part, optimizer, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part picks its own FQNs out of the merged flat dict.
        for model_part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            set_optimizer_state_dict(model_part, optimizer, optim_state_dict=state_dict, options=_FLAT)


def updates_master_weights(config: Any) -> bool:
    """Whether the optimizer that `config` builds can update fp32 masters of bf16 weights (`MultiTensorAdamW`)."""
    return config.name == "AdamW" and config.implementation == "triton"


def build_optimizers(
    model_parts: list[nn.Module],
    job_config: JobConfig,
    master_low_bits: dict[torch.Tensor, torch.Tensor] | None = None,
) -> OptimizersContainer:
    """One optimizer per model part. master_low_bits: {bf16 parameter: the low bits of its fp32 master}
    (`store_weights_in_bf16`), which the optimizer updates; needs `updates_master_weights`."""
    config = job_config.optimizer
    if master_low_bits and not updates_master_weights(config):
        raise ValueError(f"fp32 master weights need optimizer AdamW with implementation 'triton', got {config}")
    optimizer_classes = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}  # config.manager checked the name

    params_per_part = [[p for p in part.parameters() if p.requires_grad] for part in model_parts]
    kwargs = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay)
    implementation = config.implementation
    if implementation == "triton":
        if config.name == "AdamW":
            kwargs["master_low_bits"] = master_low_bits
            kwargs["moments_dtype"] = DTYPES[config.moments_dtype] if config.moments_dtype != "float32" else None
            return OptimizersContainer(model_parts, [MultiTensorAdamW(params, **kwargs) for params in params_per_part])
        logger.info("optimizer.implementation='triton' implements AdamW only; Adam uses torch's 'fused'")
        implementation = "fused"
    if implementation == "fused":
        unsupported = _devices_without_fused_kernel(p for params in params_per_part for p in params)
        if unsupported:
            logger.warning(
                f"optimizer.implementation='fused' has no kernel on device(s) {unsupported}; using 'foreach'"
            )
            implementation = "foreach"

    kwargs |= {"fused": implementation == "fused", "foreach": implementation == "foreach"}
    optimizers = [optimizer_classes[config.name](params, **kwargs) for params in params_per_part]
    return OptimizersContainer(model_parts, optimizers)


def _devices_without_fused_kernel(params: Iterator[torch.Tensor]) -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    return sorted({p.device.type for p in params} - supported)
