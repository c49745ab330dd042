"""A layer as a flat list of operations, and the state they pass through.

An operation reads named values, writes named values, and has a stream tag (the main compute
stream unless it is communication). ``fn(*[state[r] for r in reads])`` returns one value per
name in ``writes`` (a single value when there is one write, else a tuple).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from overlap import DEFAULT


@dataclasses.dataclass(frozen=True)
class Operation:
    """One launch of a layer: a named callable on a stream, with the values it reads and writes."""

    name: str
    fn: Callable[..., Any]
    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    stream: str = DEFAULT

    def run(self, state: "State") -> None:
        out = self.fn(*[state[r] for r in self.reads])
        for k, v in zip(self.writes, split_outputs(self.name, self.writes, out)):
            state[k] = v


def split_outputs(name: str, writes: Tuple[str, ...], out: Any) -> Tuple[Any, ...]:
    """What an operation returned, as one value per name in ``writes`` (checked)."""
    if len(writes) == 0:
        return ()
    if len(writes) == 1:
        return (out,)
    if not isinstance(out, tuple) or len(out) != len(writes):
        raise TypeError(f"operation {name!r} must return {len(writes)} values for {writes}")
    return out


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


def as_operation(op: Any) -> Operation:
    """An `Operation` from anything with its fields (``name, fn, reads, writes, stream``), e.g. an EP stage."""
    if isinstance(op, Operation):
        return op
    missing = [f for f in ("name", "fn", "reads", "writes") if not hasattr(op, f)]
    if missing:
        raise TypeError(f"{op!r} is not an operation: it lacks {', '.join(missing)}")
    reads, writes = tuple(op.reads), tuple(op.writes)
    for what, names in (("reads", reads), ("writes", writes)):
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"operation {op.name!r}: {what} must be names (str), got {names!r}")
    return Operation(str(op.name), op.fn, reads, writes, getattr(op, "stream", DEFAULT) or DEFAULT)


@dataclasses.dataclass(frozen=True)
class FromMicroBatch:
    """An input of one micro-batch that is other micro-batches' values of the same layer.

    Put it in a micro-batch's initial state, e.g. ``{"prefix_kv": FromMicroBatch(0, "k", "v")}``
    for micro-batch 1 when a request is cut across the two: at every layer, reading
    ``"prefix_kv"`` gives micro-batch 0's ``("k", "v")`` of that layer (one name gives the value
    itself). ``mb`` may name several micro-batches, ``FromMicroBatch((0, 1), "k", "v")`` for a
    request cut twice: the reader gets their values micro-batch by micro-batch, name by name
    (``(k0, v0, k1, v1)``). With ``fn`` the reader gets ``fn(*values)`` instead, e.g. the prefix
    rows of K/V. The executor orders the reader after every writer, across streams too.
    ``mb`` is the first micro-batch read, ``mbs`` all of them.
    """

    mb: int
    names: Tuple[str, ...]
    fn: Optional[Callable[..., Any]] = None
    mbs: Tuple[int, ...] = ()

    def __init__(self, mb: Union[int, Sequence[int]], *names: str, fn: Optional[Callable[..., Any]] = None):
        mbs = tuple(int(m) for m in mb) if isinstance(mb, (tuple, list, range)) else (int(mb),)
        if not mbs:
            raise TypeError("FromMicroBatch needs at least one micro-batch to read from")
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"FromMicroBatch({mb!r}, ...) needs the names of the values to read, got {names!r}")
        object.__setattr__(self, "mb", mbs[0])
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "mbs", mbs)
