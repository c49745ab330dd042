"""The tensors inside a value passed between operations."""
from __future__ import annotations

import dataclasses
from typing import Any, List

import torch


def tensors_in(value: Any) -> List[torch.Tensor]:
    """A tensor, or the tensors in nested tuples, lists, dicts and dataclasses (e.g. a dispatch handle)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name))]
    return []
