"""bf16 weights with fp32 masters held as the weight plus 16 low bits: mixed precision for a model FSDP does not wrap.

Under autocast every fp32 weight is cast at each use (and again in recompute). Weights that compute in bf16 are
stored in bf16 instead; the optimizer updates their fp32 masters and writes the new bf16 weights in one pass
(`MultiTensorAdamW(master_low_bits=...)`). The master is the bf16 weight plus an int16 tensor of the fp32 value's low
16 bits: 4 bytes per weight instead of 6. The weight is rounded to nearest, ties away from zero (ties to even could
not be undone); every fp32 value, NaN and inf included, joins back to itself bit for bit.

Gradients are bf16, or fp32 (`grad_dtype`) with gradient accumulation so the sum does not round per micro-batch.
The state dict holds the masters (same keys, fp32, joined on the CPU to spare GPU memory), so checkpoints see fp32
values interchangeable with an fp32 model's. DTensor parameters (routed experts under EP without FSDP) are split
and joined per local shard (DTensor's own bit shifts are not exact); their low bits are plain tensors.

Also here, for the optimizers that update masters (`MultiTensorAdamW`, `Muon`): a parameter's local shard and its
gradient laid out like it, and torch's state-dict load without its cast of state to the (bf16) parameter's dtype.
"""

from collections import defaultdict
from collections.abc import Callable, Set
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "bf16_weight_groups",
    "grad_like_param",
    "join_fp32",
    "load_state_keeping_dtypes",
    "local_shard",
    "split_fp32",
    "store_weights_in_bf16",
]

_LOW = 0xFFFF
_HALF = 0x8000


def split_fp32(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values -> (bf16 nearest with ties away from zero, int16 low bits); `join_fp32` undoes it exactly."""
    bits = values.float().contiguous().view(torch.int32)
    low = bits & _LOW
    upper = ((bits >> 16) & _LOW) + (low >= _HALF).to(torch.int32)
    return upper.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_fp32(weight: torch.Tensor, low_bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values a bf16 `weight` and its int16 `low_bits` hold (`split_fp32`)."""
    low = low_bits.to(torch.int32) & _LOW
    upper = (weight.contiguous().view(torch.int16).to(torch.int32) & _LOW) - (low >= _HALF).to(torch.int32)
    return ((upper << 16) | low).view(torch.float32)


def store_weights_in_bf16(
    model_parts: list[nn.Module], params: Set[nn.Parameter], fp32_grads: bool
) -> dict[nn.Parameter, torch.Tensor]:
    """Store `params` (parameters of `model_parts`; the trainer's are those of `bf16_weight_groups`) in bf16 after
    their fp32 init; returns {parameter: the int16 low bits of its fp32 master}."""
    low_bits: dict[nn.Parameter, torch.Tensor] = {}
    replaced: dict[nn.Parameter, nn.Parameter] = {}  # DTensor fp32 parameter -> its bf16 one
    for part in model_parts:
        for module in part.modules():
            chosen = [(n, p) for n, p in module.named_parameters(recurse=False) if p in params or p in replaced]
            if not chosen:
                continue
            own = {}
            for name, param in chosen:
                if param in replaced:  # shared with a module seen before
                    param = replaced[param]
                    module.register_parameter(name, param)
                elif param not in low_bits:
                    weight, low = split_fp32(local_shard(param.detach()))
                    if isinstance(param, DTensor):  # a new bf16 parameter (setting .data would keep the fp32 shard)
                        replaced[param] = nn.Parameter(_like(param, weight), requires_grad=param.requires_grad)
                        param = replaced[param]
                        module.register_parameter(name, param)
                    else:
                        param.data = weight
                    low_bits[param] = low
                    if fp32_grads:
                        param.grad_dtype = torch.float32
                own[name] = (param, low_bits[param])
            module.register_state_dict_post_hook(partial(_masters_in_state_dict, own))
            module.register_load_state_dict_pre_hook(partial(_load_into_masters, own))
    return low_bits


def bf16_weight_groups(
    autocast_dtype: torch.dtype | None, masters_updated: bool, param_dtype: str, experts_outside_fsdp: bool
) -> frozenset[str]:
    """The parameter groups (`optimizer.PARAMETER_GROUPS`) whose weights the trainer stores in bf16 with fp32 masters
    (`store_weights_in_bf16`): what computes in bf16 with no FSDP to cast it. Under bf16 autocast (one device), where
    the optimizers update masters (`masters_updated`), every nn.Linear's weight (matrices, head, router_gate) and the
    routed experts; under FSDP's bf16 (`param_dtype`) the routed experts FSDP leaves alone (`experts_outside_fsdp`,
    which needs such optimizers); else none. The trainer stores the parameters of these groups, the plan counts them."""
    if autocast_dtype == torch.bfloat16 and masters_updated:
        return frozenset({"matrices", "head", "router_gate", "experts"})
    if param_dtype == "bfloat16" and experts_outside_fsdp:
        return frozenset({"experts"})
    return frozenset()


def _masters_in_state_dict(masters: dict[str, tuple], module: nn.Module, state_dict: dict, prefix: str, *_: Any):
    for name, (param, low_bits) in masters.items():
        if prefix + name in state_dict:
            master = join_fp32(local_shard(param.detach()).cpu(), low_bits.cpu())
            if isinstance(param, DTensor):  # a DTensor of the parameter's layout holding the CPU shard
                value = param.detach().to(device="cpu", dtype=torch.float32)
                value.to_local().copy_(master)
                master = value
            state_dict[prefix + name] = master


def _load_into_masters(masters: dict[str, tuple], module: nn.Module, state_dict: dict, prefix: str, *_: Any):
    for name, (param, low_bits) in masters.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value is not param and value.shape == param.shape:
            weight, low = split_fp32(local_shard(value.detach()).to(param.device))
            with torch.no_grad():
                local_shard(param).copy_(weight)
                low_bits.copy_(low)
            # the loader's own copy into the parameter must not round the master again
            state_dict[prefix + name] = param


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def grad_like_param(param: torch.Tensor) -> torch.Tensor:
    """The gradient laid out like the parameter (an update pairs their local shards): a DTensor gradient on another
    layout (partial sums under tensor parallelism) is redistributed, as DTensor does for torch's optimizers."""
    grad = param.grad
    if isinstance(grad, DTensor) and (grad.placements != param.placements or grad.device_mesh != param.device_mesh):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def load_state_keeping_dtypes(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    state_dtype: Callable[[torch.Tensor], torch.dtype],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """`load(state_dict)` (torch's `Optimizer.load_state_dict`, which casts each loaded state tensor to its
    parameter's dtype) with the state of each parameter in `state_dtype(parameter)`: while it runs, the groups hold a
    stand-in (one element, expanded) of that dtype for each parameter whose state has another dtype (fp32 for a bf16
    weight with a master)."""
    stand_ins = {
        param: torch.zeros((), dtype=state_dtype(param), device=param.device).expand(param.shape)
        for group in optimizer.param_groups
        for param in group["params"]
        if state_dtype(param) != param.dtype
    }
    parameter_of = {id(stand_in): param for param, stand_in in stand_ins.items()}
    for group in optimizer.param_groups:
        group["params"] = [stand_ins.get(param, param) for param in group["params"]]
    try:
        load(state_dict)
    finally:
        for group in optimizer.param_groups:
            group["params"] = [parameter_of.get(id(param), param) for param in group["params"]]
        optimizer.state = defaultdict(dict, {parameter_of.get(id(p), p): state for p, state in optimizer.state.items()})


def _like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of `param`'s layout whose local shard is `local` (already on the shard's device)."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
