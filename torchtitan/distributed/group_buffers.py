"""The buffers token exchanges keep per process group (DeepEP's `deep_ep.Buffer`, symm_mem's symmetric tensors), in
one registry for every exchange. Ops cannot take a `ProcessGroup`: they are handed the group's name and find its
buffers here. An exchange's ParallelStyle makes them at parallelize time (collectively, on CUDA); the exchange
backend's `release` frees them all after training, before the process groups go. Nothing per call is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["group_buffers", "keep_group_buffers", "release_group_buffers", "required_group_buffers"]


@dataclass
class _Kept:
    buffers: Any
    free: Callable[[Any], None]


_KEPT: dict[tuple[str, str], _Kept] = {}
"""(exchange, group name) -> that exchange's buffers for the group, and how to free them."""


def group_buffers(exchange: str, group_name: str) -> Any | None:
    """The buffers `exchange` (its ops' namespace: `deepep`, `symm_mem`) keeps for the group, or None."""
    kept = _KEPT.get((exchange, group_name))
    return None if kept is None else kept.buffers


def required_group_buffers(exchange: str, group_name: str, how_to_make: str) -> Any:
    """The buffers `exchange` keeps for the group; where it keeps none (its ops ran before its ParallelStyle was
    applied), an error that says `how_to_make` them."""
    buffers = group_buffers(exchange, group_name)
    if buffers is None:
        raise RuntimeError(
            f"no {exchange} buffers for process group {group_name!r}: {how_to_make} before running the {exchange} ops"
        )
    return buffers


def keep_group_buffers(exchange: str, group_name: str, buffers: Any, free: Callable[[Any], None]) -> None:
    """Register the group's `buffers` of `exchange`, freed by `free(buffers)` on release; those they replace are
    freed first."""
    release_group_buffers(exchange, group_name)
    _KEPT[(exchange, group_name)] = _Kept(buffers, free)


def release_group_buffers(exchange: str | None = None, group_name: str | None = None) -> None:
    """Free the registered buffers: of one exchange, of one group, or all of them (the default). Collective where
    freeing them is (DeepEP's destroy): every rank of each group calls it."""
    for key in [key for key in _KEPT if exchange in (None, key[0]) and group_name in (None, key[1])]:
        kept = _KEPT.pop(key)
        kept.free(kept.buffers)
