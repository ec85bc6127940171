"""The optimizers of all model parts (pipeline stages) behind one container the trainer steps once.

Each parameter falls in one group by rule (`parameter_group`): `matrices` (attention and MLP weights), `experts` (the
routed experts' stacked (E, out, in) weights), `embeddings`, `head`, `router_gate`, `norms_and_biases`. Per part:
`--optimizer.name AdamW` (or `Adam`) steps every parameter, weight decay on all (norms, embeddings too, as
torchtitan); `Muon` steps the groups of `optimizer.muon_groups` (`muon.py`) and AdamW the others, both with the job's
lr and weight decay (Moonlight's recipe). AdamW is `MultiTensorAdamW` (adamw.py) for implementation `triton`, else
torch.optim's.

What an optimizer needs of the model it declares as class attributes, which the trainer and parallelize read through
this module instead of testing names: `updates_master_weights` (bf16 weights stored with fp32 masters it updates,
`master_weights.py`) and `folds_grad_scale` (`step(grad_scale=c)`: gradient clipping folded into the update).

The container's state dict is the *flattened* optimizer state dict of `torch.distributed.checkpoint.state_dict`:
keys are parameter FQNs (`state.layers.0.wq.weight.exp_avg`, `...momentum_buffer` under Muon), values DTensors where
the parameters are sharded, so pipeline stages and a part's optimizers never collide and DCP can reshard into another
layout. torch.optim.AdamW and MultiTensorAdamW save the same keys; an AdamW checkpoint does not resume under Muon nor
the reverse (`resume_mismatch`).
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
from torchtitan.components.muon import Muon
from torchtitan.config.job_config import PARAMETER_GROUPS, JobConfig
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = [
    "PARAMETER_GROUPS",
    "OptimizersContainer",
    "build_optimizers",
    "group_parameters",
    "muon_groups",
    "parameter_group",
    "state_bytes_per_parameter",
    "updates_master_weights",
]

StepHook = Callable[["OptimizersContainer", tuple, dict], None]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """Steps, zeroes, saves and loads the optimizers of all model parts as one.

    `register_step_pre_hook` hooks run once per `step()`, before any optimizer steps, with this container as the
    optimizer argument; not forwarded to the per-part optimizers, where a whole-model hook would run once per part and
    inside DCP's optimizer-state initialisation.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers_per_part: list[list[torch.optim.Optimizer]]) -> None:
        if len(model_parts) != len(optimizers_per_part):
            raise ValueError(f"got {len(model_parts)} model parts but optimizers for {len(optimizers_per_part)}")
        self.model_parts = model_parts
        self.optimizers_per_part = optimizers_per_part
        self.optimizers = [optimizer for optimizers in optimizers_per_part for optimizer in optimizers]
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
        for model_part, optimizers in zip(self.model_parts, self.optimizers_per_part, strict=True):
            state.update(get_optimizer_state_dict(model_part, optimizers, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part's optimizers pick their own FQNs out of the merged flat dict.
        for model_part, optimizers in zip(self.model_parts, self.optimizers_per_part, strict=True):
            set_optimizer_state_dict(model_part, optimizers, optim_state_dict=state_dict, options=_FLAT)

    def resume_mismatch(self, checkpoint_keys: set[str], prefix: str = "optimizer.") -> str | None:
        """What the optimizer state in a checkpoint (its DCP keys, this container's under `prefix`) lacks of this
        run's, said after "cannot resume from <path>: "; None when it holds all of it. Another optimizer's
        checkpoint (AdamW's moments where Muon keeps a momentum) would otherwise fail inside DCP on a missing key."""
        ours = self.state_dict()
        missing = [key for key in ours if key.startswith("state.") and prefix + key not in checkpoint_keys]
        # a parameter whose state the checkpoint holds under other names; one it holds no state for at all is
        # another model's (a shape or flavor change), which the model's own load names
        for key in missing:
            parameter = key.removeprefix("state.").rpartition(".")[0]
            if saved := _state_names(checkpoint_keys, f"{prefix}state.{parameter}."):
                break
        else:
            return None
        kept = _state_names(ours, f"state.{parameter}.")
        kinds = ", ".join(sorted({type(optimizer).__name__ for optimizer in self.optimizers}))
        return (
            f"its optimizer state is another optimizer's ({len(missing)} tensors missing; for {parameter} it holds "
            f"{saved}, this run's {kinds} keeps {kept}): resume with the --optimizer.name it was saved "
            "with, or start from its weights in another --job.dump_folder with --checkpoint.initial_load_path <it> "
            "--checkpoint.initial_load_model_only"
        )


def _state_names(keys: Any, prefix: str) -> list[str]:
    return sorted(key.removeprefix(prefix) for key in keys if key.startswith(prefix))


def parameter_group(name: str, param: torch.Tensor, module: nn.Module) -> str:
    """The group (`PARAMETER_GROUPS`) of the parameter `name` (its FQN) held by `module`, by the model's structure
    (docs/design.md): vectors are norms and biases; 3-D weights stacked experts; `tok_embeddings` an nn.Embedding;
    the head the top-level `output`; the router gate a module named `router.gate`."""
    if param.ndim < 2:
        return "norms_and_biases"
    if param.ndim == 3:
        return "experts"
    if isinstance(module, nn.Embedding):
        return "embeddings"
    module_name = name.rpartition(".")[0]
    if module_name == "output":
        return "head"
    if module_name == "router.gate" or module_name.endswith(".router.gate"):
        return "router_gate"
    return "matrices"


def group_parameters(model_part: nn.Module) -> dict[nn.Parameter, str]:
    """{trainable parameter: its group} of `model_part`, each parameter once, in module order."""
    groups: dict[nn.Parameter, str] = {}
    for module_name, module in model_part.named_modules():
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            if param.requires_grad and param not in groups:
                groups[param] = parameter_group(name, param, module)
    return groups


def updates_master_weights(config: Any) -> bool:
    """Whether every optimizer that `config` (JobConfig.optimizer) builds updates fp32 masters of bf16 weights."""
    return all(getattr(cls, "updates_master_weights", False) for cls in _optimizer_classes(config))


def muon_groups(config: Any) -> tuple[str, ...]:
    """The parameter groups Muon steps under `config` (JobConfig.optimizer): none unless the optimizer is Muon."""
    return tuple(config.muon_groups) if config.name == "Muon" else ()


def state_bytes_per_parameter(config: Any) -> dict[str, int]:
    """{parameter group: bytes of optimizer state per parameter} of the optimizers `config` (JobConfig.optimizer)
    builds: Adam's two moments, in `moments_dtype` where `MultiTensorAdamW` keeps them so, else fp32 (the weights' or
    their masters' dtype); Muon's momentum buffer for its groups, fp32 for the same reason."""
    moment = DTYPES[config.moments_dtype].itemsize if _adam_class(config) is MultiTensorAdamW else 4
    return {group: 4 if group in muon_groups(config) else 2 * moment for group in PARAMETER_GROUPS}


def build_optimizers(
    model_parts: list[nn.Module],
    job_config: JobConfig,
    master_low_bits: dict[torch.Tensor, torch.Tensor] | None = None,
) -> OptimizersContainer:
    """The optimizers of every model part (module docstring). master_low_bits: {bf16 parameter: the low bits of its
    fp32 master} (`store_weights_in_bf16`), which the optimizers update; needs `updates_master_weights`."""
    config = job_config.optimizer
    if master_low_bits and not updates_master_weights(config):
        raise ValueError(
            f"fp32 master weights need optimizers that update them (AdamW or Muon with implementation 'triton'), "
            f"got {config.name} with {config.implementation!r}"
        )
    adam_class, adam_kwargs = _adam(config, model_parts, master_low_bits)
    optimizers_per_part = []
    for part in model_parts:
        groups = group_parameters(part)
        muon_params = [param for param, group in groups.items() if group in muon_groups(config)]
        adam_params = [param for param, group in groups.items() if group not in muon_groups(config)]
        optimizers: list[torch.optim.Optimizer] = []
        if muon_params:
            optimizers.append(
                Muon(
                    muon_params,
                    lr=config.lr,
                    weight_decay=config.weight_decay,
                    momentum=config.muon_momentum,
                    nesterov=config.muon_nesterov,
                    ns_steps=config.muon_ns_steps,
                    update_scale=config.muon_update_scale,
                    update_rms=config.muon_update_rms,
                    master_low_bits=master_low_bits,
                )
            )
        if adam_params:
            optimizers.append(adam_class(adam_params, **adam_kwargs))
        optimizers_per_part.append(optimizers)
    return OptimizersContainer(model_parts, optimizers_per_part)


def _optimizer_classes(config: Any) -> list[type[torch.optim.Optimizer]]:
    """The classes `build_optimizers` builds from `config` (the implementation `fused` may still fall back to
    `foreach` within torch's class)."""
    adam = _adam_class(config)
    return [Muon, adam] if config.name == "Muon" else [adam]


def _adam_class(config: Any) -> type[torch.optim.Optimizer]:
    """AdamW for `AdamW` and beside Muon, `MultiTensorAdamW` with implementation `triton`; torch's Adam for `Adam`."""
    if config.name == "Adam":
        return torch.optim.Adam
    return MultiTensorAdamW if config.implementation == "triton" else torch.optim.AdamW


def _adam(
    config: Any, model_parts: list[nn.Module], master_low_bits: dict[torch.Tensor, torch.Tensor] | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The Adam(W) class and its keyword arguments, the implementation resolved once for every part."""
    cls = _adam_class(config)
    kwargs: dict[str, Any] = dict(
        lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay
    )
    if cls is MultiTensorAdamW:
        kwargs["master_low_bits"] = master_low_bits
        kwargs["moments_dtype"] = DTYPES[config.moments_dtype] if config.moments_dtype != "float32" else None
        return cls, kwargs
    implementation = config.implementation
    if implementation == "triton":
        logger.info("optimizer.implementation='triton' implements AdamW only; Adam uses torch's 'fused'")
        implementation = "fused"
    if implementation == "fused":
        unsupported = _devices_without_fused_kernel(p for part in model_parts for p in part.parameters())
        if unsupported:
            logger.warning(
                f"optimizer.implementation='fused' has no kernel on device(s) {unsupported}; using 'foreach'"
            )
            implementation = "foreach"
    return cls, kwargs | {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def _devices_without_fused_kernel(params: Iterator[torch.Tensor]) -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    return sorted({p.device.type for p in params} - supported)
