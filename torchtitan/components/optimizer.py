"""The optimizers of all model parts (pipeline stages) behind one container the trainer steps once.

Each parameter falls in one group by rule (`parameter_group`): `matrices` (attention and MLP weights), `experts` (the
routed experts' stacked (E, out, in) weights), `embeddings`, `head`, `router_gate`, `norms_and_biases`. Per part:
`--optimizer.name AdamW` (or `Adam`) steps every parameter, weight decay on all (norms, embeddings too, as
torchtitan); `Muon` steps the groups of `muon.groups` (`muon.py`) and AdamW the others, both with the job's lr and
weight decay (Moonlight's recipe). AdamW is `MultiTensorAdamW` (adamw.py) for implementation `triton`, else
torch.optim's.

`OPTIMIZERS` is one row per name: the classes it builds and the config section of its own settings. What a class can
do (update fp32 masters, fold clipping, keep bf16 moments) and costs (state bytes, step FLOPs) it declares itself
(`OptimizerRow`); config checks, the trainer, parallelize and the plan ask through this module, never test names.

The container's state dict is the *flattened* optimizer state dict of `torch.distributed.checkpoint.state_dict`:
keys are parameter FQNs (`state.layers.0.wq.weight.exp_avg`, `...momentum_buffer` under Muon), values DTensors where
the parameters are sharded, so pipeline stages and a part's optimizers never collide and DCP can reshard into another
layout. torch.optim.AdamW and MultiTensorAdamW save the same keys; an AdamW checkpoint does not resume under Muon nor
the reverse (`resume_mismatch`).
"""

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.utils.hooks import RemovableHandle

from torchtitan.components.adamw import MultiTensorAdamW
from torchtitan.components.muon import Muon
from torchtitan.config import ConfigError
from torchtitan.config.job_config import PARAMETER_GROUPS, JobConfig
from torchtitan.tools.dtypes import DTYPES

logger = logging.getLogger(__name__)

__all__ = [
    "OPTIMIZERS",
    "PARAMETER_GROUPS",
    "OptimizerRow",
    "OptimizersContainer",
    "build_optimizers",
    "check_optimizer",
    "group_parameters",
    "grouped_step_flops",
    "keeps_bf16_moments",
    "masters_updated_by",
    "parameter_group",
    "section_groups",
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


@dataclass(frozen=True)
class OptimizerRow:
    """What one `--optimizer.name` builds (a row of `OPTIMIZERS`). What each class can do it declares itself, and the
    functions below ask it: the class attributes `updates_master_weights` (bf16 weights stored with fp32 masters it
    updates, `master_weights.py`), `folds_grad_scale` (`step(grad_scale=c)`: gradient clipping folded into the
    update) and `bf16_moments` (`moments_dtype=torch.bfloat16`), `state_bytes(moments_dtype)` (optimizer state per
    parameter) and, for `grouped`, `step_flops(shape, **settings)`. torch.optim's classes declare none of them: no
    masters, clipping apart, two moments in the parameters' dtype."""

    base: Mapping[str, type[torch.optim.Optimizer]]
    """Per `optimizer.implementation` the row runs: the class that steps every parameter `grouped` does not take (all
    of them without `grouped`) with the job's lr, betas, eps and weight decay. An implementation missing here runs
    `fused`."""

    grouped: type[torch.optim.Optimizer] | None = None
    """The class that steps the parameter groups its section names (`<section>.groups`), with the job's lr and weight
    decay and the section's other settings as keyword arguments."""

    section: str | None = None
    """`grouped`'s section of JobConfig: settings that apply under this row only (`check_optimizer`)."""

    def base_class(self, implementation: str) -> type[torch.optim.Optimizer]:
        return self.base.get(implementation, self.base["fused"])

    def classes(self, implementation: str) -> list[type[torch.optim.Optimizer]]:
        """The classes the row builds with `implementation` (`fused` may still fall back to `foreach` within torch's
        class where the device has no fused kernel)."""
        base = self.base_class(implementation)
        return [self.grouped, base] if self.grouped is not None else [base]


_ADAMW = {"triton": MultiTensorAdamW} | dict.fromkeys(("fused", "foreach", "for-loop"), torch.optim.AdamW)

OPTIMIZERS: dict[str, OptimizerRow] = {
    "AdamW": OptimizerRow(_ADAMW),
    "Adam": OptimizerRow(dict.fromkeys(("fused", "foreach", "for-loop"), torch.optim.Adam)),
    "Muon": OptimizerRow(_ADAMW, grouped=Muon, section="muon"),
}
"""Every `--optimizer.name` and what it builds. A new optimizer is its class, a row here, and in job_config.py its name
among `Optimizer.name`'s choices and the section of its own settings, if any (a test holds the names equal)."""


def check_optimizer(job_config: JobConfig) -> None:
    """What the table allows of the job's optimizer settings (preflight, before any process group): a
    `moments_dtype` other than fp32 only where the base class keeps moments so, and a row's section set under that
    row only (it would silently not apply). Raises ConfigError naming the fix."""
    config, defaults = job_config.optimizer, JobConfig()
    row = OPTIMIZERS[config.name]
    if config.moments_dtype != "float32" and not _bf16_moments(row, config.implementation):
        raise ConfigError(
            f"optimizer.moments_dtype={config.moments_dtype} needs an update that keeps its moments so "
            f"({_which(_bf16_moments)}), got {config.name} with {config.implementation!r}; switch to it or "
            "drop --optimizer.moments_dtype"
        )
    for name, other in OPTIMIZERS.items():
        if other.section is None or other.section == row.section:
            continue
        settings, default = getattr(job_config, other.section), getattr(defaults, other.section)
        for field in dataclasses.fields(settings):
            if getattr(settings, field.name) != getattr(default, field.name):
                raise ConfigError(
                    f"{other.section}.{field.name} applies to --optimizer.name {name}, got {config.name}; pass "
                    f"--optimizer.name {name} or drop it"
                )


def updates_master_weights(job_config: JobConfig) -> bool:
    """Whether every optimizer the job builds updates fp32 masters of bf16 weights."""
    return _updates_masters(OPTIMIZERS[job_config.optimizer.name], job_config.optimizer.implementation)


def keeps_bf16_moments(job_config: JobConfig) -> bool:
    """Whether `--optimizer.moments_dtype bfloat16` applies to the job's optimizer (its Adam moments)."""
    return _bf16_moments(OPTIMIZERS[job_config.optimizer.name], job_config.optimizer.implementation)


def masters_updated_by() -> str:
    """The optimizer settings whose classes all update fp32 masters, for messages."""
    return _which(_updates_masters)


def section_groups(job_config: JobConfig) -> tuple[str, ...]:
    """The parameter groups the job's optimizer gives its `grouped` class (Muon's `muon.groups`); () without one."""
    row = OPTIMIZERS[job_config.optimizer.name]
    return tuple(getattr(job_config, row.section).groups) if row.grouped is not None else ()


def state_bytes_per_parameter(job_config: JobConfig) -> dict[str, int]:
    """{parameter group: bytes of optimizer state per parameter} of the optimizers the job builds, as their classes
    state them (torch.optim's Adam(W): two fp32 moments, the dtype of the weights or FSDP's shards they run on)."""
    config = job_config.optimizer
    row, moments_dtype = OPTIMIZERS[config.name], DTYPES[config.moments_dtype]
    base = _state_bytes(row.base_class(config.implementation), moments_dtype)
    grouped = _state_bytes(row.grouped, moments_dtype) if row.grouped is not None else base
    own = section_groups(job_config)
    return {group: grouped if group in own else base for group in PARAMETER_GROUPS}


def grouped_step_flops(job_config: JobConfig, shape: tuple[int, ...]) -> float:
    """FLOPs of one step of the job's `grouped` class (Muon's Newton-Schulz iteration) on a parameter of `shape`;
    0 without one."""
    row = OPTIMIZERS[job_config.optimizer.name]
    return row.grouped.step_flops(shape, **_settings(job_config)) if row.grouped is not None else 0.0


def build_optimizers(
    model_parts: list[nn.Module],
    job_config: JobConfig,
    master_low_bits: dict[torch.Tensor, torch.Tensor] | None = None,
) -> OptimizersContainer:
    """The optimizers of every model part (module docstring). master_low_bits: {bf16 parameter: the low bits of its
    fp32 master} (`store_weights_in_bf16`), which the optimizers update; needs `updates_master_weights`."""
    config = job_config.optimizer
    if master_low_bits and not updates_master_weights(job_config):
        raise ValueError(
            f"fp32 master weights need optimizers that update them ({masters_updated_by()}), got {config.name} "
            f"with {config.implementation!r}"
        )
    row, own = OPTIMIZERS[config.name], section_groups(job_config)
    base_class, base_kwargs = _base(job_config, model_parts, master_low_bits)
    optimizers_per_part = []
    for part in model_parts:
        groups = group_parameters(part)
        grouped_params = [param for param, group in groups.items() if group in own]
        base_params = [param for param, group in groups.items() if group not in own]
        optimizers: list[torch.optim.Optimizer] = []
        if grouped_params:
            optimizers.append(
                row.grouped(
                    grouped_params,
                    lr=config.lr,
                    weight_decay=config.weight_decay,
                    master_low_bits=master_low_bits,
                    **_settings(job_config),
                )
            )
        if base_params:
            optimizers.append(base_class(base_params, **base_kwargs))
        optimizers_per_part.append(optimizers)
    return OptimizersContainer(model_parts, optimizers_per_part)


def _updates_masters(row: OptimizerRow, implementation: str) -> bool:
    return all(getattr(cls, "updates_master_weights", False) for cls in row.classes(implementation))


def _bf16_moments(row: OptimizerRow, implementation: str) -> bool:
    return getattr(row.base_class(implementation), "bf16_moments", False)


def _state_bytes(cls: type[torch.optim.Optimizer], moments_dtype: torch.dtype) -> int:
    return cls.state_bytes(moments_dtype) if hasattr(cls, "state_bytes") else 2 * 4  # torch.optim's: 2 fp32 moments


def _which(holds: Callable[[OptimizerRow, str], bool]) -> str:
    """The names and implementations for which `holds`, for messages: `--optimizer.name AdamW or Muon with
    --optimizer.implementation triton`."""
    pairs = [(name, impl) for name, row in OPTIMIZERS.items() for impl in row.base if holds(row, impl)]
    names = " or ".join(dict.fromkeys(name for name, _ in pairs))
    implementations = " or ".join(dict.fromkeys(impl for _, impl in pairs))
    return f"--optimizer.name {names} with --optimizer.implementation {implementations}"


def _settings(job_config: JobConfig) -> dict[str, Any]:
    """The keyword arguments of the row's `grouped` class from its section: every setting but its `groups`."""
    section = getattr(job_config, OPTIMIZERS[job_config.optimizer.name].section)
    return {field.name: getattr(section, field.name) for field in dataclasses.fields(section) if field.name != "groups"}


def _base(
    job_config: JobConfig, model_parts: list[nn.Module], master_low_bits: dict[torch.Tensor, torch.Tensor] | None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The row's base class and its keyword arguments, the implementation resolved once for every part."""
    config = job_config.optimizer
    row, implementation = OPTIMIZERS[config.name], config.implementation
    kwargs: dict[str, Any] = dict(
        lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay
    )
    if implementation not in row.base:
        logger.info(f"optimizer.implementation={implementation!r} has no {config.name} update; it uses torch's 'fused'")
        implementation = "fused"
    cls = row.base_class(implementation)
    if implementation == "triton":  # ours (MultiTensorAdamW): the masters and the moments' dtype, one kernel
        moments_dtype = DTYPES[config.moments_dtype] if config.moments_dtype != "float32" else None
        return cls, kwargs | {"master_low_bits": master_low_bits, "moments_dtype": moments_dtype}
    # torch.optim's kernels, chosen by its flags
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
