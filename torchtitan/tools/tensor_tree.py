"""Tensors inside the nested tuples, lists and dataclasses that the MoE dispatcher stages pass around."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors", "tensors_in"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with `fn` applied to every tensor in it, through nested tuples, lists and dataclasses. Containers are
    rebuilt only where a tensor changed (the others are returned as they are), never modified."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(item, fn) for item in obj]
        return obj if all(new is old for new, old in zip(items, obj, strict=True)) else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            new = map_tensors(value, fn)
            if new is not value:
                changed[field.name] = new
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in nested tuples, lists and dataclasses, in `map_tensors` order."""
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda tensor: found.append(tensor) or tensor)
    return found
