"""Activation checkpointing per transformer block: none, full, every Nth block, or per-op selective (SAC).

Per-op SAC saves the outputs of expensive or communicating ops (`op_sac_save_list`) and recomputes the rest in
backward: every matmul (torchtitan saves every other one, but the expert GEMMs dominate the MoE's activations); topk
and the stable sort, so the order of token copies cannot change on recompute; attention kernels; collectives and
device-to-host copies, so recompute neither communicates nor syncs (full AC gathers the CP latent again in backward);
aten.max (amax-like reductions that low-precision recipes reuse); the exchange backend's ops, passed in
(`ExchangeBackend.sac_save_ops`).

In MoE blocks per-op SAC checkpoints only the routed experts (`GroupedExperts.recompute`), whose per-copy activations
are most of the block's memory; the rest keeps its activations, since an eager checkpoint of the whole block replays
its Python in backward and left the GPU idle. The exchange lies outside the checkpoint. Compiled, the policy is
applied by the partitioner inside the graph, with no checkpoint machinery on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan.distributed.compile import CompiledRegion, Compiler, MoERegions, recompile_guard_contexts

__all__ = ["PartialRecompute", "SwitchableCheckpointWrapper", "apply_ac", "per_op_sac_contexts"]


@runtime_checkable
class PartialRecompute(Protocol):
    """A block that per-op SAC checkpoints in part, not whole (an MoE block: its routed experts, module docstring).
    `recompute_part(on)` switches that part's recompute and returns True; a block without such a part returns False
    and is checkpointed whole. A block with a part also compiles its parts itself (`compile.CompiledParts`), so a
    whole-block checkpoint of it runs compiled regions eagerly and gets the recompile guard."""

    def recompute_part(self, on: bool) -> bool: ...


def op_sac_save_list() -> set[Any]:
    """The ops whose outputs per-op SAC saves (those present in this torch build)."""
    aten, ops = torch.ops.aten, torch.ops
    candidates = [
        lambda: aten.mm.default,
        lambda: aten.bmm.default,
        lambda: aten.addmm.default,
        lambda: aten._scaled_mm.default,
        lambda: aten._grouped_mm.default,
        lambda: ops.torchtitan.cpu_grouped_mm.default,  # the bf16 one on CPU (kernels/cpu_grouped_mm.py)
        lambda: aten._scaled_grouped_mm.default,
        lambda: ops.torchtitan.fp8_scaled_grouped_mm_emulated.default,  # its CPU emulation (kernels/float8.py)
        lambda: aten._scaled_dot_product_efficient_attention.default,
        lambda: aten._scaled_dot_product_flash_attention.default,
        lambda: aten._scaled_dot_product_flash_attention_for_cpu.default,
        lambda: aten._scaled_dot_product_cudnn_attention.default,
        lambda: aten._scaled_dot_product_attention_math.default,
        lambda: aten._scaled_dot_product_fused_attention_overrideable.default,
        lambda: ops._c10d_functional.reduce_scatter_tensor.default,
        lambda: ops.torchtitan.cp_all_gather.default,  # distributed/context_parallel.py, when imported
        lambda: ops._c10d_functional.all_to_all_single.default,
        lambda: ops._c10d_functional_autograd.all_to_all_single.default,
        lambda: ops._c10d_functional_autograd.reduce_scatter_tensor.default,
        lambda: aten._local_scalar_dense.default,
        lambda: aten.max.default,
        lambda: aten.topk.default,
        lambda: aten.sort.stable,
        lambda: torch._higher_order_ops.flex_attention,
    ]
    save = set()
    for candidate in candidates:
        try:
            save.add(candidate())
        except (AttributeError, RuntimeError):  # op not in this torch build
            continue
    return save


def apply_ac(
    model: nn.Module,
    ac_config: Any,
    compiled_regions: tuple[CompiledRegion, ...] = (),
    exchange_ops: Iterable[Any] = (),
) -> list[tuple[SwitchableCheckpointWrapper, nn.Module]]:
    """Wrap the blocks of `model.layers` (and `model.mtp`) in non-reentrant checkpoint wrappers per `ac_config`.

    "full": every block. "selective", option "op": per-op SAC on every dense block and on every MoE block's routed
    experts; option N: every Nth block by position, fully. `num_blocks` (>= 0) keeps only blocks below it. Whole-block
    checkpoints of MoE blocks get `compile.recompile_guard_contexts` over `compiled_regions`. `exchange_ops`: the
    exchange backend's ops, which per-op SAC saves too.

    Returns (its switchable wrapper, block) of each block a memory budget switches (under per-op SAC with
    `activation_checkpoint.memory_budget_gib`, `activation_budget.py`), in forward order; empty without a budget.
    """
    mode, option = ac_config.mode, str(ac_config.selective_ac_option)
    num_blocks = ac_config.num_blocks
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode={mode!r}: use none, full or selective")
    if mode == "selective" and option != "op" and (not option.isdigit() or int(option) < 1):
        raise ValueError(
            f"activation_checkpoint.selective_ac_option={option!r}: use 'op' or a positive integer N "
            "(checkpoint every Nth block)"
        )
    every = int(option) if mode == "selective" and option != "op" else 1

    def selected(position: int) -> bool:
        return position % every == 0 and (num_blocks == -1 or position < num_blocks)

    sac_save_ops = op_sac_save_list() | set(exchange_ops) if mode == "selective" and option == "op" else None
    return _wrap_blocks(model, selected, sac_save_ops, compiled_regions, switchable=ac_config.memory_budget_gib > 0)


def per_op_sac_contexts(exchange_ops: Iterable[Any] = ()):
    """The (forward, recompute) contexts of the per-op SAC policy, also saving `exchange_ops`: a `context_fn` for
    torch.utils.checkpoint (bind the ops with functools.partial)."""
    return _sac_contexts(op_sac_save_list() | set(exchange_ops))


class SwitchableCheckpointWrapper(CheckpointWrapper):
    """A block's checkpoint wrapper whose level a memory budget sets (`activation_budget.py`), `sac` until then:
    `full` checkpoints the block whole; `sac` is per-op SAC, run by this wrapper with `sac_context_fn` (a dense block)
    or, without one, by the block on its own part (an MoE block's routed experts, `PartialRecompute`); `none` runs the
    block plainly. Parameter names are a checkpoint-wrapped block's."""

    def __init__(self, module: nn.Module, full_context_fn: Callable | None, sac_context_fn: Callable | None = None):
        kwargs = {"context_fn": full_context_fn} if full_context_fn is not None else {}
        super().__init__(module, preserve_rng_state=False, **kwargs)
        self._sac_checkpoint = (
            partial(checkpoint, use_reentrant=False, preserve_rng_state=False, context_fn=sac_context_fn)
            if sac_context_fn is not None
            else None
        )
        self.level = "sac"
        self._compiled_forward: Callable | None = None

    @property
    def recomputes_part(self) -> bool:
        """Its block runs per-op SAC on a part of itself (an MoE block), not this wrapper on the whole block."""
        return self._sac_checkpoint is None

    def compile_parts(self, compiler: Compiler, regions: MoERegions) -> bool:
        """`compile.CompiledParts`: a dense block's wrapper compiles its forward, not its module call, so the
        budget's hooks (which read the allocator) stay outside the graph; an MoE block compiles its own parts."""
        if self.recomputes_part:
            return False
        self._compiled_forward = compiler.function(self._forward_at_level)
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self._compiled_forward or self._forward_at_level)(*args, **kwargs)

    def _forward_at_level(self, *args: Any, **kwargs: Any) -> Any:
        if self.level == "full":
            return super().forward(*args, **kwargs)
        if self.level == "sac" and self._sac_checkpoint is not None:
            return self._sac_checkpoint(self._checkpoint_wrapped_module, *args, **kwargs)
        return self._checkpoint_wrapped_module(*args, **kwargs)


def _wrap_blocks(
    model: nn.Module,
    selected: Callable[[int], bool],
    sac_save_ops: set[Any] | None,
    compiled_regions: tuple[CompiledRegion, ...],
    switchable: bool = False,
) -> list[tuple[SwitchableCheckpointWrapper, nn.Module]]:
    """Checkpoint the selected blocks; per-op SAC when `sac_save_ops` is given, else whole-block recompute.
    switchable: blocks under per-op SAC get `SwitchableCheckpointWrapper`s, whose level a memory budget sets; returns
    those (wrapper, block) pairs."""
    switchable_blocks = []
    # the transformer blocks, then the multi-token prediction modules (blocks too), by position
    blocks = [(model.layers, "layers", name, block) for name, block in model.layers.named_children()]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += [(mtp, "mtp", name, block) for name, block in mtp.named_children()]
    for position, (container, prefix, name, block) in enumerate(blocks):
        if not selected(position):
            continue
        has_part = isinstance(block, PartialRecompute) and block.recompute_part(sac_save_ops is not None)
        guard_name = f"{prefix}.{name}" if has_part and compiled_regions else None
        guarded = compiled_regions if guard_name is not None else ()  # dynamo traces a dense block's partial
        whole = partial(_checkpoint_contexts, None, guard_name, guarded) if guard_name is not None else None
        sac = partial(_checkpoint_contexts, sac_save_ops, None, ()) if sac_save_ops is not None else None
        if switchable and sac is not None:  # a memory budget sets the level (activation_budget.py)
            wrapper = SwitchableCheckpointWrapper(block, whole, None if has_part else sac)
            container.register_module(name, wrapper)
            switchable_blocks.append((wrapper, block))
        elif has_part and sac is not None:
            continue  # the block checkpoints its part itself
        else:
            # dynamo traces a dense block's checkpoint: pass no context_fn unless there is something to run in it
            context_fn = sac if sac is not None else whole
            kwargs = {"context_fn": context_fn} if context_fn is not None else {}
            container.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs))
    return switchable_blocks


def _checkpoint_contexts(
    sac_save_ops: set[Any] | None, guard_name: str | None, compiled_regions: tuple[CompiledRegion, ...]
):
    """checkpoint's context_fn: (forward, recompute) contexts of SAC or, for a whole MoE block, the recompile guard
    (never both: `_wrap_blocks` does not checkpoint an MoE block whole under per-op SAC)."""
    if sac_save_ops is not None:
        return _sac_contexts(sac_save_ops)
    return recompile_guard_contexts(guard_name, compiled_regions)


LOW_RANK_INNER_DIM = 128
"""A GEMM contracting over at most this many and widening it at least LOW_RANK_WIDENING-fold (LoRA's up projection B,
(out, r)) is recomputed, not saved: its output is as wide as the layer's but costs only 2 r FLOPs per element."""
LOW_RANK_WIDENING = 8


def _sac_contexts(save_ops: set[Any]):
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in save_ops and not _low_rank_gemm(func, args):
            return CheckpointPolicy.MUST_SAVE
        if func is torch.ops.aten._to_copy.default and _is_device_to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _low_rank_gemm(func: Any, args: tuple) -> bool:
    """Whether `func(*args)` is a matmul (mm, bmm, grouped; addmm's operands follow the bias) from a low rank up
    (LOW_RANK_INNER_DIM)."""
    name = getattr(func, "__name__", "")
    if "mm" not in name or "scaled" in name:
        return False
    operands = args[1:3] if name.startswith("addmm") else args[:2]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in operands):
        return False
    inner, out = operands[0].shape[-1], operands[1].shape[-1]
    return inner <= LOW_RANK_INNER_DIM and out >= LOW_RANK_WIDENING * inner


def _is_device_to_host(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device")
    return (
        target is not None
        and torch.device(target).type == "cpu"
        and isinstance(args[0], torch.Tensor)
        and args[0].device.type != "cpu"
    )
