"""AdamW that updates all parameters of a (param dtype, grad dtype) bucket of a param group in one kernel launch on
CUDA, with the gradient-clipping coefficient folded into the update.

The update is torch.optim.AdamW's: p *= 1 - lr * wd; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), bc = 1 - beta^step per parameter. `step(grad_scale=c)` uses
g = c * grad and leaves the gradients in memory unscaled.

State keys, layout and param-group keys are torch.optim.AdamW's, so flattened DCP optimizer state dicts load across
the two classes both ways. CUDA parameters use the Triton kernel of `multi_tensor_kernels.py`; other devices torch's
foreach ops (the same update). DTensor parameters are updated through their local shards.

`master_low_bits` ({bf16 parameter: int16 low bits of its fp32 master}, `master_weights.py`): the update runs on the
fp32 master and writes it back split in the same pass. Its state is made at construction (DCP's own state init sets
zero gradients of the parameter's dtype, refused where `grad_dtype` is fp32).

`moments_dtype=torch.bfloat16`: both moments stored in bf16 (made at construction, kept bf16 by a load), the update
still in fp32. They are rounded stochastically, so each is right in expectation: rounded to nearest, a change below
half a bf16 ulp (0.2-0.4% of the moment) would be lost every step, a one-signed error that adds up.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan.components.master_weights import (
    grad_like_param,
    join_fp32,
    load_state_keeping_dtypes,
    local_shard,
    split_fp32,
)
from torchtitan.kernels.adamw_update import AdamWUpdate
from torchtitan.kernels.multi_tensor import cuda_kernels

__all__ = ["MultiTensorAdamW"]

# Param-group keys of torch.optim.AdamW that say how torch steps, not what: kept so that DCP's flattened state dict,
# which reads every key of the loading optimizer's groups, finds them in both directions. This class ignores them.
_TORCH_ONLY_KEYS = dict(foreach=None, fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)


class MultiTensorAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update in one launch per bucket on CUDA; `step(grad_scale=c)` scales gradients by c."""

    folds_grad_scale = True  # OptimizersContainer.step(grad_scale=...) passes the clip coefficient here
    updates_master_weights = True  # bf16 weights may be stored with fp32 masters (master_weights.py)
    bf16_moments = True  # moments_dtype=torch.bfloat16 keeps both moments in bf16

    @staticmethod
    def state_bytes(moments_dtype: torch.dtype) -> int:
        """Optimizer state per parameter: the two moments (the step count is one scalar per tensor)."""
        return 2 * moments_dtype.itemsize

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        master_low_bits: Mapping[torch.Tensor, torch.Tensor] | None = None,
        moments_dtype: torch.dtype | None = None,
    ) -> None:
        _check_supported({"amsgrad": amsgrad, "maximize": maximize})
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, {**defaults, **_TORCH_ONLY_KEYS})
        self.master_low_bits = dict(master_low_bits or {})
        self.moments_dtype = moments_dtype
        if self.master_low_bits or moments_dtype is not None:
            for group in self.param_groups:
                for param in group["params"]:
                    self._state(param)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scale: torch.Tensor | None = None) -> Any:
        """One AdamW step over every parameter with a gradient; `grad_scale` (a 0-dim tensor, e.g. the clip
        coefficient, kept on device: no host sync) multiplies each gradient inside the update, not in memory."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_supported(group)  # a loaded state dict may have switched them on
            for bucket in self._buckets(group).values():
                _step_bucket(bucket, group, grad_scale)
        return loss

    def _buckets(self, group: dict[str, Any]) -> dict[tuple, "_Bucket"]:
        """The group's parameters with gradients, as local tensors, by (device, param dtype, grad dtype)."""
        buckets: dict[tuple, _Bucket] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise ValueError("MultiTensorAdamW does not take sparse gradients: use torch.optim.SparseAdam")
            state = self._state(param)
            if state["step"].device.type != "cpu":
                # a checkpoint of torch's fused AdamW keeps steps on the GPU: one copy here, then no syncs
                state["step"] = state["step"].cpu()
            low_bits = self.master_low_bits.get(param)
            local_param, local_grad = local_shard(param), local_shard(grad_like_param(param))
            key = (local_param.device, local_param.dtype, local_grad.dtype, low_bits is not None)
            bucket = buckets.setdefault(key, _Bucket())
            if low_bits is not None:
                bucket.low_bits.append(local_shard(low_bits))
            bucket.params.append(local_param)
            bucket.grads.append(local_grad)
            bucket.exp_avgs.append(local_shard(state["exp_avg"]))
            bucket.exp_avg_sqs.append(local_shard(state["exp_avg_sq"]))
            bucket.steps.append(state["step"])
        return buckets

    def _moments_dtype(self, param: torch.Tensor) -> torch.dtype:
        """`moments_dtype`, else fp32 where the parameter has a master, else the parameter's dtype (torch's)."""
        if self.moments_dtype is not None:
            return self.moments_dtype
        return torch.float32 if param in self.master_low_bits else param.dtype

    def _state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter's state, made as torch.optim.AdamW (neither fused nor capturable) makes it, with moments of
        `_moments_dtype`."""
        state = self.state[param]
        if not state:
            dtype = self._moments_dtype(param)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts each loaded moment to its parameter's dtype, keeping the moments' own dtype (fp32
        for a bf16 weight with a master, bf16 moments)."""
        load_state_keeping_dtypes(self, state_dict, self._moments_dtype, super().load_state_dict)


@dataclass
class _Bucket:
    """Parameters stepped together: one device, one parameter dtype, one gradient dtype, with or without masters."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)  # 0-dim fp32 CPU tensors
    low_bits: list[torch.Tensor] = field(default_factory=list)  # int16, of the bf16 `params`' fp32 masters


def _step_bucket(bucket: _Bucket, group: dict[str, Any], grad_scale: torch.Tensor | None) -> None:
    torch._foreach_add_(bucket.steps, 1.0)
    lr, weight_decay, eps = float(group["lr"]), group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    # per parameter, in float64 on the host as torch computes them (steps may differ: a parameter without a
    # gradient in some step did not advance)
    steps = torch.stack(bucket.steps).tolist()
    # stochastic rounding: a new seed each step, the same on every rank and after a resume, an int32 for the kernel
    rounding_seed = int(steps[0]) * 0x9E3779B1 % 2**31
    step_sizes = [lr / (1 - beta1**step) for step in steps]
    bias_correction2_sqrts = [(1 - beta2**step) ** 0.5 for step in steps]
    device = bucket.params[0].device
    update = AdamWUpdate(
        bucket.params,
        bucket.grads,
        bucket.exp_avgs,
        bucket.exp_avg_sqs,
        step_sizes,
        bias_correction2_sqrts,
        decay_factor=1 - lr * weight_decay,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        grad_scale=None if grad_scale is None else grad_scale.to(device),
        low_bits=bucket.low_bits or None,
        rounding_seed=rounding_seed,
    )
    if device.type == "cuda":
        cuda_kernels().adamw_update_(update)
    else:
        _foreach_adamw_update_(update)


def _round_to_bf16_stochastically(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 `value` to bf16, rounded up in magnitude with probability (its 16 dropped bits) / 2^16: the expected
    result is `value` (the Triton kernel's `_round_to_bf16_stochastically`, with torch's generator)."""
    random = torch.randint(0, 2**16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    return ((value.view(torch.int32) + random) & -(2**16)).view(torch.float32).to(torch.bfloat16)


def _foreach_adamw_update_(update: AdamWUpdate) -> None:
    """The update with torch's foreach ops, in torch's foreach AdamW's order. With `low_bits` it runs on the joined fp32
    masters and splits them back; moments of another dtype are updated in the (master) params' dtype and rounded back
    (stochastically into bf16, seeded by `rounding_seed`)."""
    params, grads, exp_avgs, exp_avg_sqs = update.params, update.grads, update.exp_avgs, update.exp_avg_sqs
    low_bits = update.low_bits
    bf16_params = None
    if low_bits is not None:
        bf16_params, params = params, [join_fp32(param, low) for param, low in zip(params, low_bits, strict=True)]
    stored_moments = None
    if exp_avgs[0].dtype != params[0].dtype:
        stored_moments = exp_avgs, exp_avg_sqs
        exp_avgs = [moment.to(params[0].dtype) for moment in exp_avgs]
        exp_avg_sqs = [moment.to(params[0].dtype) for moment in exp_avg_sqs]
    if grads[0].dtype != params[0].dtype:
        grads = [grad.to(params[0].dtype) for grad in grads]
    if update.grad_scale is not None:
        grads = torch._foreach_mul(grads, update.grad_scale)  # new tensors: the gradients stay as they are
    torch._foreach_mul_(params, update.decay_factor)
    torch._foreach_lerp_(exp_avgs, grads, 1 - update.beta1)
    torch._foreach_mul_(exp_avg_sqs, update.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - update.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, update.bias_correction2_sqrts)
    torch._foreach_add_(denom, update.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-step_size for step_size in update.step_sizes])
    if stored_moments is not None:
        generator = torch.Generator(params[0].device).manual_seed(update.rounding_seed)
        for stored, moment in zip([*stored_moments[0], *stored_moments[1]], [*exp_avgs, *exp_avg_sqs], strict=True):
            stored.copy_(_round_to_bf16_stochastically(moment, generator) if stored.dtype == torch.bfloat16 else moment)
    if bf16_params is not None:
        for bf16_param, low, master in zip(bf16_params, low_bits, params, strict=True):
            weight, new_low = split_fp32(master)
            bf16_param.copy_(weight)
            low.copy_(new_low)


def _check_supported(group: dict[str, Any]) -> None:
    for option in ("amsgrad", "maximize"):
        if group[option]:
            raise ValueError(
                f"MultiTensorAdamW does not implement {option}=True: set --optimizer.implementation foreach "
                "(torch.optim.AdamW)"
            )
