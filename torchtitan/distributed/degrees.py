"""Whether the parallel degrees fill the world size and divide the model; where they do not, the degree that is the
limit and values that fit, computed by trying them (preflight's one-line error; the plan's `--nnodes`)."""

from __future__ import annotations

from math import lcm
from typing import Any

from torchtitan.config import ConfigError
from torchtitan.distributed.parallel_dims import ParallelDims

__all__ = ["LayoutError", "check_parallel_dims", "smallest_world_size"]

FLAGS = {
    "pp": "pipeline_parallel_degree",
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
    "etp": "expert_tensor_parallel_degree",
}
LAUNCH = "(NNODES x NGPU)"


class LayoutError(ConfigError):
    """Degrees that do not fill the world size or divide the model; the job's degrees and model args travel with it,
    so a caller that launches otherwise (the plan, in nodes) can ask which world size fits."""

    def __init__(self, message: str, dims: ParallelDims, model_args: Any) -> None:
        super().__init__(message)
        self.dims, self.model_args = dims, model_args

    def smallest_world_size(self, multiple_of: int = 1) -> int | None:
        return smallest_world_size(self.dims, self.model_args, multiple_of)


def check_parallel_dims(dims: ParallelDims, model_args: Any) -> None:
    """The degrees must multiply out to the world size, leave EP whole ranks to borrow, and divide the model; else
    LayoutError naming values that fit."""
    found = _problem(dims, model_args)
    if found is None:
        return
    message, kind = found
    fixes: list[str] = []
    launch = _launch(dims, model_args)
    outer = [name for name in _outer(dims) if getattr(dims, name) > 1]
    if kind == "world":
        fixes += [launch] if launch else []
        fixes += _lowered(
            dims, model_args, [name for name in ("pp", "dp_replicate", "cp", "tp") if getattr(dims, name) > 1]
        )
        if not dims.dp_shard_filled and dims.world_size % _others(dims) == 0:
            fixes += _set(dims, model_args, "dp_shard", dims.world_size // _others(dims))
        fallback = "lower those degrees or launch more processes (NGPU)"
    elif kind == "ep":
        if dims.dp_shard_filled and outer:  # the rest of the world size is what EP borrows: those degrees are the limit
            limits = " and ".join(f"{FLAGS[name]} {getattr(dims, name)}" for name in outer)
            leave = "leaves" if len(outer) == 1 else "leave"
            message += f", and {limits} {leave} it {_borrowable(dims)} of the {dims.world_size} processes"
            fixes += _lowered(dims, model_args, outer)
        fixes += _lowered(dims, model_args, ["ep"])
        fixes += _set(dims, model_args, "etp", 1) if dims.etp > 1 else []
        fixes += [launch] if launch else []
        fallback = "change expert_parallel_degree"
    else:  # a degree the model does not divide: kind names it (etp is 1 or tp)
        fixes += _set(dims, model_args, "etp", 1) if kind == "etp" else _lowered(dims, model_args, [kind])
        fallback = (
            f"set --parallelism.{FLAGS[kind]} to a divisor" if kind != "pp" else f"lower --parallelism.{FLAGS[kind]}"
        )
    raise LayoutError(f"{message}; {_either(fixes) if fixes else fallback}", dims, model_args)


def smallest_world_size(dims: ParallelDims, model_args: Any, multiple_of: int = 1) -> int | None:
    """The fewest processes, a multiple of `multiple_of` (a node's GPUs), that these degrees fill with the model
    divided; None where no world size does (the model does not divide, or a given dp_shard fixes another size)."""
    others = _others(dims)
    if not dims.dp_shard_filled:
        world = others * dims.dp_shard
        return world if world % multiple_of == 0 and _fits(_relaid(dims, world_size=world), model_args) else None
    # dp_shard is the rest: every multiple of `others` is a candidate, and EP fits by others * ep at the latest
    step = lcm(others, multiple_of)
    for world in range(step, lcm(others * dims.ep, multiple_of) + 1, step):
        if _fits(_relaid(dims, world_size=world), model_args):
            return world
    return None


def _problem(dims: ParallelDims, model_args: Any) -> tuple[str, str] | None:
    """(what is wrong, its kind: "world", "ep", or the degree the model does not divide), or None."""
    others = _others(dims)
    if 1 <= dims.world_size < others:
        return (
            f"dp_replicate({dims.dp_replicate}) * cp({dims.cp}) * tp({dims.tp}) * pp({dims.pp}) = {others} processes "
            f"at least, but the world size is {dims.world_size}",
            "world",
        )
    if dims.world_size < 1 or dims.world_size != others * dims.dp_shard:
        filled = (
            "; data_parallel_shard_degree=-1 fills in the rest when the world size is a multiple of dp_replicate * "
            f"cp * tp * pp = {others}"
        )
        return (
            f"dp_replicate({dims.dp_replicate}) * dp_shard({dims.dp_shard}) * cp({dims.cp}) * tp({dims.tp}) * "
            f"pp({dims.pp}) = {others * dims.dp_shard} but the world size is {dims.world_size}{filled}",
            "world",
        )
    if dims.etp > 1 and dims.dp_shard % dims.ep:  # experts are TP-sharded, so EP can only borrow data-parallel ranks
        return (
            f"expert_parallel_degree ({dims.ep}) must divide data_parallel_shard_degree ({dims.dp_shard}) when "
            "expert_tensor_parallel_degree == tensor_parallel_degree: EP borrows data-parallel ranks only",
            "ep",
        )
    if dims.etp == 1 and dims.dp_shard * dims.cp * dims.tp % dims.ep:
        return (
            f"expert_parallel_degree ({dims.ep}) must divide data_parallel_shard_degree * context_parallel_degree * "
            f"tensor_parallel_degree ({dims.dp_shard} * {dims.cp} * {dims.tp} = {dims.dp_shard * dims.cp * dims.tp}): "
            "EP borrows its ranks from FSDP, CP and TP",
            "ep",
        )
    for name, count, what in [
        ("ep", model_args.moe_args.num_experts, "moe num_experts"),
        ("etp", model_args.moe_inter_dim, "moe_inter_dim"),
        ("tp", model_args.n_heads, "n_heads"),
    ]:
        if count % getattr(dims, name):
            return f"{what} ({count}) is not divisible by {FLAGS[name]} ({getattr(dims, name)})", name
    if model_args.n_layers < dims.pp:
        return (
            f"n_layers ({model_args.n_layers}) is smaller than pipeline_parallel_degree ({dims.pp}); every stage needs "
            "at least one layer",
            "pp",
        )
    return None


def _fits(dims: ParallelDims, model_args: Any) -> bool:
    return _problem(dims, model_args) is None


def _others(dims: ParallelDims) -> int:
    return dims.dp_replicate * dims.cp * dims.tp * dims.pp


def _outer(dims: ParallelDims) -> list[str]:
    """The degrees that divide the world size before EP borrows: EP borrows dp_shard, cp and tp (etp 1), or
    dp_shard only (etp == tp)."""
    return ["pp", "dp_replicate"] if dims.etp == 1 else ["pp", "dp_replicate", "cp", "tp"]


def _borrowable(dims: ParallelDims) -> int:
    return dims.dp_shard if dims.etp > 1 else dims.dp_shard * dims.cp * dims.tp


def _relaid(dims: ParallelDims, **changes: int) -> ParallelDims:
    """`dims` with some degrees (or the world size) changed; a dp_shard that was filled in is filled in again."""
    if "tp" in changes and dims.etp > 1:  # etp is 1 or tp
        changes.setdefault("etp", changes["tp"])
    degrees = dict(
        dp_replicate=dims.dp_replicate, dp_shard=-1 if dims.dp_shard_filled else dims.dp_shard, tp=dims.tp, pp=dims.pp,
        ep=dims.ep, etp=dims.etp, world_size=dims.world_size, cp=dims.cp,
    )  # fmt: skip
    return ParallelDims(**{**degrees, **changes})


def _lowered(dims: ParallelDims, model_args: Any, names: list[str]) -> list[str]:
    """For each degree in `names`, the largest value below its own that fits at this world size, the rest kept."""
    fixes = []
    for name in names:
        values = range(getattr(dims, name) - 1, 0, -1)
        value = next((v for v in values if _fits(_relaid(dims, **{name: v}), model_args)), None)
        if value is not None:
            fixes.append(f"--parallelism.{FLAGS[name]} {value}")
    return fixes


def _set(dims: ParallelDims, model_args: Any, name: str, value: int) -> list[str]:
    return [f"--parallelism.{FLAGS[name]} {value}"] if _fits(_relaid(dims, **{name: value}), model_args) else []


def _launch(dims: ParallelDims, model_args: Any) -> str | None:
    world = smallest_world_size(dims, model_args)
    if world is None or world == dims.world_size:
        return None
    return f"launch {'a multiple of ' if dims.dp_shard_filled else ''}{world} processes {LAUNCH}"


def _either(fixes: list[str]) -> str:
    """'launch ..., or pass --a 1, or --b 2': the fixes in their order, the first flag with its verb."""
    parts, passed = [], False
    for fix in fixes:
        if fix.startswith("--") and not passed:
            fix, passed = f"pass {fix}", True
        parts.append(fix)
    return ", or ".join(parts)
