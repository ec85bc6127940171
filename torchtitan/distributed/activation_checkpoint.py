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
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.distributed.compile import CompiledRegion, recompile_guard_contexts

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

    Returns (its switchable wrapper, MoE block) of each MoE block a memory budget switches
    (`activation_checkpoint.memory_budget_gib`, `activation_budget.py`), in forward order; empty without a budget.
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
    """A block's checkpoint wrapper that runs the block plainly while `enabled` is False (a memory budget's levels:
    `activation_budget.py`). Parameter names are a checkpoint-wrapped block's."""

    def __init__(self, module: nn.Module, context_fn: Callable | None):
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        super().__init__(module, preserve_rng_state=False, **kwargs)
        self.enabled = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.enabled:
            return super().forward(*args, **kwargs)
        return self._checkpoint_wrapped_module(*args, **kwargs)


def _wrap_blocks(
    model: nn.Module,
    selected: Callable[[int], bool],
    sac_save_ops: set[Any] | None,
    compiled_regions: tuple[CompiledRegion, ...],
    switchable: bool = False,
) -> list[tuple[SwitchableCheckpointWrapper, nn.Module]]:
    """Checkpoint the selected blocks; per-op SAC when `sac_save_ops` is given, else whole-block recompute.
    switchable: MoE blocks under per-op SAC are also wrapped whole, switched off (a memory budget's `full` level);
    returns those (wrapper, block) pairs."""
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
        if has_part and sac_save_ops is not None:
            if switchable:  # a memory budget may recompute the whole block instead (activation_budget.py)
                whole = partial(_checkpoint_contexts, None, guard_name, guarded) if guard_name is not None else None
                wrapper = SwitchableCheckpointWrapper(block, whole)
                container.register_module(name, wrapper)
                switchable_blocks.append((wrapper, block))
            continue
        # dynamo traces a dense block's checkpoint: pass no context_fn unless there is something to run in it
        kwargs = {}
        if sac_save_ops is not None or guard_name is not None:
            kwargs["context_fn"] = partial(_checkpoint_contexts, sac_save_ops, guard_name, guarded)
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


def _sac_contexts(save_ops: set[Any]):
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in save_ops:
            return CheckpointPolicy.MUST_SAVE
        if func is torch.ops.aten._to_copy.default and _is_device_to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _is_device_to_host(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device")
    return (
        target is not None
        and torch.device(target).type == "cpu"
        and isinstance(args[0], torch.Tensor)
        and args[0].device.type != "cpu"
    )
