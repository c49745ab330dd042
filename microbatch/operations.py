"""A layer as a flat list of operations, and the state they pass through.

An operation reads named values, writes named values, and has a stream tag (the main compute
stream unless it is communication). ``fn(*[state[r] for r in reads])`` returns one value per
name in ``writes`` (a single value when there is one write, else a tuple).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, Tuple

from overlap.streams import MAIN


@dataclasses.dataclass(frozen=True)
class Operation:
    """One launch of a layer: a named callable on a stream, with the values it reads and writes."""

    name: str
    fn: Callable[..., Any]
    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    stream: str = MAIN

    def run(self, state: "State") -> None:
        out = self.fn(*[state[r] for r in self.reads])
        if len(self.writes) == 1:
            out = (out,)
        elif len(self.writes) == 0:
            return
        if not isinstance(out, tuple) or len(out) != len(self.writes):
            raise TypeError(f"operation {self.name!r} must return {len(self.writes)} values for {self.writes}")
        for k, v in zip(self.writes, out):
            state[k] = v


class State(dict):
    """Values passed between operations; writing a name twice is an error, not a silent overwrite."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise KeyError(f"value {key!r} is already set; operations must not overwrite each other's outputs")
        super().__setitem__(key, value)

    def __getitem__(self, key: str) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            raise KeyError(f"value {key!r} is read before any operation wrote it (have: {sorted(self)})") from None

    def pop_many(self, keys: Iterable[str]) -> Dict[str, Any]:
        return {k: self.pop(k) for k in keys}
