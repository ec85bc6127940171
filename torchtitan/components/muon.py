"""Muon for the hidden layers' matrices: momentum, orthogonalized by a Newton-Schulz iteration, as Moonlight trained.

The update (torch.optim.Muon's; Keller Jordan's iteration; the scaling of "Muon is Scalable for LLM Training"):

    B = mu B + (1 - mu) g                momentum; g = c * grad with `step(grad_scale=c)` (clipping folded in)
    U = (1 - mu) g + mu B  (Nesterov)  or  B
    O = NS_k(U)                          ~ the orthogonal polar factor U_svd V_svd^T of U
    W = W (1 - lr wd) - lr s(A, B) O     decoupled weight decay; s per A x B matrix (`update_scale`)

Moonlight writes the momentum as B = mu B + g, U = g + mu B: (1 - mu) times these, which the iteration's
normalization removes; this form's buffer is torch.optim.Muon's `momentum_buffer`, so their states interchange.

`match_rms_adamw`: s = r sqrt(max(A, B)) gives O the update RMS r that AdamW has (Moonlight: r = 0.2, "AdamW's
typical 0.2-0.4"), so AdamW's lr and weight decay carry over (Moonlight's recipe); `original`: Keller Jordan's
sqrt(max(1, A / B)). A 3-D parameter is a stack of matrices (the routed experts' (E, out, in)): each expert's
matrix is orthogonalized and scaled on its own.

Layouts: the iteration needs whole matrices. Where a mesh dimension shards a matrix dimension (FSDP's rows, TP's
rows or columns), the updates of same-layout parameters are stacked and re-sharded over the stack (DTensor's
all-to-all): each rank gets whole matrices, its share of the stack, orthogonalizes them, and the all-to-all back
returns each rank its shards. Shards of the stacked experts' dimension (EP, FSDP over experts) hold whole matrices
already: each rank orthogonalizes its own experts. Replicated mesh dimensions (HSDP's replicas) repeat the work, as
they repeat every other update. Pipeline stages have an optimizer each.

`master_low_bits` ({bf16 parameter: int16 low bits of its fp32 master}, `master_weights.py`): the update runs on the
fp32 master and writes it back split. The momentum is fp32 for those, else in the parameter's dtype. The iteration
runs in bf16 on CUDA (its GEMMs are the cost), in fp32 elsewhere; on CUDA the elementwise updates around it (momentum,
decay and step) are one compiled kernel each.
"""

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan.components.master_weights import (
    grad_like_param,
    join_fp32,
    load_state_keeping_dtypes,
    local_shard,
    split_fp32,
)

__all__ = [
    "Muon",
    "apply_update",
    "momentum_update",
    "newton_schulz",
    "newton_schulz_flops",
    "orthogonalize",
    "update_scale",
]

# Keller Jordan's quintic: the largest slope at zero that still keeps every singular value in about [0.7, 1.2]
KELLER_JORDAN_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NORM_EPS = 1e-7

UpdateScale = Literal["match_rms_adamw", "original"]


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters and stacks of them (3-D: one matrix per leading index); see the module docstring."""

    folds_grad_scale = True  # OptimizersContainer.step(grad_scale=...) passes the clip coefficient here
    updates_master_weights = True  # bf16 weights may be stored with fp32 masters (master_weights.py)

    @staticmethod
    def state_bytes(moments_dtype: torch.dtype) -> int:
        """Optimizer state per parameter: one momentum buffer, fp32 (the masters' dtype, or the fp32 weights');
        Adam's `moments_dtype` does not apply."""
        return 4

    @staticmethod
    def step_flops(shape: tuple[int, ...], ns_steps: int = 5, **settings: Any) -> int:
        """FLOPs of one step on a parameter of `shape` under the constructor's settings: its Newton-Schulz
        iteration's GEMMs (`newton_schulz_flops`); the elementwise updates around them are memory-bound."""
        return newton_schulz_flops(shape, ns_steps)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        update_scale: UpdateScale = "match_rms_adamw",
        update_rms: float = 0.2,
        master_low_bits: Mapping[torch.Tensor, torch.Tensor] | None = None,
        ns_dtype: torch.dtype | None = None,
        max_elements_per_batch: int = 2**28,
        compile_updates: bool | None = None,
    ) -> None:
        """`update_rms`: r of `match_rms_adamw` (module docstring). `ns_dtype`: the iteration's dtype (None: bf16 on
        CUDA, fp32 elsewhere). `max_elements_per_batch`: how many matrix elements one rank orthogonalizes at once
        (bounds the iteration's temporary memory). `compile_updates`: run the elementwise updates (the momentum;
        decay and step on the weight or its master) as one compiled kernel each instead of a dozen eager passes over
        every weight (None: where the parameters are on CUDA)."""
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            update_scale=update_scale,
        )
        super().__init__(params, defaults)
        self.update_rms = update_rms  # not a group key: checkpoints from before it resume, the job's value applies
        self.master_low_bits = dict(master_low_bits or {})
        self.ns_dtype = ns_dtype
        self.max_elements_per_batch = max_elements_per_batch
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalizes matrices (2-D) and stacks of them (3-D), got a parameter of shape "
                        f"{tuple(param.shape)}: give it to AdamW (components/optimizer.py's parameter groups)"
                    )
                # made now: DCP's own state init would run a step
                self.state[param]["momentum_buffer"] = torch.zeros_like(param, dtype=self._momentum_dtype(param))
        if compile_updates is None:
            compile_updates = {p.device.type for group in self.param_groups for p in group["params"]} == {"cuda"}
        # one graph per variant (master or not, clip or not), any size: `step` passes flat views
        compiled = partial(torch.compile, fullgraph=True, dynamic=True)
        self._momentum_update = compiled(momentum_update) if compile_updates else momentum_update
        self._apply_update = compiled(apply_update) if compile_updates else apply_update

    def _momentum_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if param in self.master_low_bits else param.dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scale: torch.Tensor | None = None) -> Any:
        """One Muon step over every parameter with a gradient; `grad_scale` (a 0-dim tensor, e.g. the clip
        coefficient) multiplies each gradient inside the update, not in memory."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            for batch in _same_layout_batches(params, self.max_elements_per_batch):
                device = local_shard(batch[0]).device
                dtype = self.ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
                scale = None if grad_scale is None else grad_scale.to(device)
                # the elementwise updates see flat views: one compiled graph per variant, whatever the shapes
                updates = [
                    self._momentum_update(
                        _flat(local_shard(self.state[param]["momentum_buffer"])),
                        _flat(local_shard(grad_like_param(param))),
                        scale,
                        group["momentum"],
                        group["nesterov"],
                        dtype,
                    ).view(local_shard(param).shape)
                    for param in batch
                ]
                orthogonal = orthogonalize(batch, updates, partial(newton_schulz, steps=group["ns_steps"]))
                lr = float(group["lr"])
                decay = torch.tensor(1 - lr * group["weight_decay"])  # tensors: a compiled update takes any value
                step_size = torch.tensor(lr * update_scale(batch[0].shape, group["update_scale"], self.update_rms))
                for param, update in zip(batch, orthogonal, strict=True):
                    low_bits = self.master_low_bits.get(param)
                    low_bits = None if low_bits is None else _flat(local_shard(low_bits))
                    self._apply_update(_flat(local_shard(param)), low_bits, update.reshape(-1), decay, step_size)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, keeping fp32 momentum for bf16 weights with masters (torch would cast it to bf16)."""
        load_state_keeping_dtypes(self, state_dict, self._momentum_dtype, super().load_state_dict)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor on the storage of a contiguous `tensor` (updated in place through it). Not a view: dynamo guards a
    view on its base's shape, which would recompile the updates for every shape of the model."""
    if not tensor.is_contiguous():
        raise ValueError(f"Muon updates contiguous tensors in place, got strides {tensor.stride()}")
    flat = tensor.new_empty(0)
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),))


def momentum_update(
    momentum: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    momentum_factor: float,
    nesterov: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """B = mu B + (1 - mu) g in place, g = grad_scale * grad (the gradient itself stays as it is); returns U (module
    docstring) in `dtype`."""
    grad = grad.to(momentum.dtype)
    if grad_scale is not None:
        grad = grad * grad_scale
    momentum.lerp_(grad, 1 - momentum_factor)
    return (grad.lerp(momentum, momentum_factor) if nesterov else momentum).to(dtype)


def apply_update(
    weight: torch.Tensor,
    low_bits: torch.Tensor | None,
    orthogonal: torch.Tensor,
    decay: torch.Tensor,
    step_size: torch.Tensor,
) -> None:
    """W = decay W - step_size O in place; on the fp32 master where the bf16 weight has `low_bits`."""
    step = orthogonal.float() * step_size
    if low_bits is None:
        weight.copy_(weight * decay - step)
        return
    new_weight, new_low = split_fp32(join_fp32(weight, low_bits) * decay - step)
    weight.copy_(new_weight)
    low_bits.copy_(new_low)


def update_scale(shape: torch.Size, rule: UpdateScale, rms: float = 0.2) -> float:
    """s(A, B) for the A x B matrices of a parameter of `shape` (the last two dimensions); `rms`: the update RMS
    `match_rms_adamw` gives (an orthogonal A x B matrix has RMS 1 / sqrt(max(A, B)))."""
    rows, cols = shape[-2:]
    if rule == "match_rms_adamw":
        return rms * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"update_scale must be 'match_rms_adamw' or 'original', got {rule!r}")


def newton_schulz(
    matrices: torch.Tensor, steps: int, coefficients: tuple[float, float, float] = KELLER_JORDAN_COEFFICIENTS
) -> torch.Tensor:
    """`steps` iterations X <- a X + (b X X^T + c (X X^T)^2) X from X = M / |M|_F, per matrix of `matrices` (..., A, B),
    in their dtype. An odd polynomial of M: the same singular vectors, singular values mapped towards 1 (Keller
    Jordan's coefficients: into about [0.7, 1.2] in 5 steps; (1.5, -0.5, 0) is the classic cubic that converges to
    exactly 1). Each step is three batched GEMMs with the polynomial's scalars applied in their epilogues
    (baddbmm's alpha and beta): nothing elementwise is left for a compiler to fuse."""
    a, b, c = coefficients
    shape = matrices.shape
    x = matrices.reshape(math.prod(shape[:-2]), *shape[-2:])  # (n, A, B); n may be 0
    transposed = shape[-2] > shape[-1]
    if transposed:  # X X^T is then the smaller Gram matrix (n, min(A, B), min(A, B))
        x = x.mT
    # the Frobenius norm bounds the spectral norm: every singular value starts in [0, 1]
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=_NORM_EPS)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, polynomial, x, beta=a)
    if transposed:
        x = x.mT
    return x.reshape(shape)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """GEMM FLOPs of `newton_schulz` with `steps` iterations on each matrix of a parameter of `shape` (..., A, B):
    per step X X^T, its square and the product with X, 4 m^2 n + 2 m^3 for the matrix's m <= n sides."""
    small, large = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * small * small * large + 2 * small**3)


def orthogonalize(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    iterate: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """`iterate` (the Newton-Schulz iteration) applied to whole matrices of `updates`, each laid out like its
    parameter's local shard; the parameters share one layout (`_same_layout_batches`). Returns the results in the
    updates' layout. Each matrix is orthogonalized on one rank of the ranks that shard it (module docstring)."""
    param = params[0]
    if not _shards_a_matrix_dim(param):
        return list(iterate(torch.stack(updates)).unbind(0))
    mesh, placements = param.device_mesh, param.placements
    # FSDP over TP's shards of the same dimension is a strided shard; as nested plain shards the stack re-shards
    nested = tuple(Shard(_sharded_dim(p)) if _sharded_dim(p) is not None else p for p in placements)
    strided = any(type(p) is not type(q) for p, q in zip(placements, nested, strict=True))
    if strided:
        updates = [_redistribute(update, param, placements, nested) for update in updates]
    stacked = tuple(Shard(p.dim + 1) if p.is_shard() else p for p in nested)
    # the stack's index sharded over every mesh dimension that shards a matrix: each rank gets whole matrices
    owned = tuple(Shard(0) if _is_matrix_shard(p, param.ndim) else s for p, s in zip(nested, stacked, strict=True))
    shape = torch.Size((len(updates), *param.shape))
    mine = _dtensor(torch.stack(updates), mesh, stacked, shape).redistribute(mesh, owned)
    done = _dtensor(iterate(mine.to_local()), mesh, owned, shape).redistribute(mesh, stacked)
    results = list(done.to_local().unbind(0))
    if strided:
        results = [_redistribute(result, param, nested, placements) for result in results]
    return results


def _same_layout_batches(params: list[torch.Tensor], max_elements: int) -> Iterator[list[torch.Tensor]]:
    """The parameters in lists of one shape and layout, each list at most about `max_elements` of whole matrices
    per rank of the ranks that share its iteration (at least one parameter per rank)."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        layout = (param.device_mesh, param.placements) if isinstance(param, DTensor) else (param.device,)
        buckets.setdefault((tuple(param.shape), *layout), []).append(param)
    for bucket in buckets.values():
        param = bucket[0]
        ranks = _matrix_sharding_ranks(param)
        per_rank = max(1, max_elements // (local_shard(param).numel() * ranks))
        size = per_rank * ranks
        for start in range(0, len(bucket), size):
            yield bucket[start : start + size]


def _sharded_dim(placement: Any) -> int | None:
    """The tensor dimension `placement` shards (FSDP's strided shard of a TP shard too), else None."""
    return placement.dim if placement.is_shard() or isinstance(placement, _StridedShard) else None


def _is_matrix_shard(placement: Any, ndim: int) -> bool:
    dim = _sharded_dim(placement)
    return dim is not None and dim >= ndim - 2


def _shards_a_matrix_dim(param: torch.Tensor) -> bool:
    return _matrix_sharding_ranks(param) > 1


def _matrix_sharding_ranks(param: torch.Tensor) -> int:
    """How many ranks hold pieces of each of the parameter's matrices."""
    if not isinstance(param, DTensor):
        return 1
    sizes = [param.device_mesh.size(i) for i, p in enumerate(param.placements) if _is_matrix_shard(p, param.ndim)]
    return math.prod(sizes)


def _dtensor(local: torch.Tensor, mesh: Any, placements: tuple, shape: torch.Size) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride)


def _redistribute(local: torch.Tensor, param: DTensor, source: tuple, target: tuple) -> torch.Tensor:
    """`local`, a shard of a tensor of `param`'s shape laid out by `source`, as its shard under `target`."""
    return _dtensor(local, param.device_mesh, source, param.shape).redistribute(param.device_mesh, target).to_local()
