"""A happens-before checker for the toolkit's logical streams (runs on CPU, models device semantics).

In the spirit of PyTorch's CUDA sanitizer, but on the tags of `overlap.stream`, so a missing
wait shows up on a CPU machine even when the CPU happened to run things in a safe order:

- every stream has a vector clock; each operation on a stream advances the stream's own entry;
  ``event.record`` on stream S snapshots S's clock and ``event.wait`` on stream T merges that
  snapshot into T's; ``overlap.synchronize()`` (the host waits for everything) joins all clocks,
  ``Event.synchronize()`` merges the event into every stream;
- tensor accesses of compute on the host thread are seen through a ``TorchDispatchMode`` and
  belong to ``overlap.current_stream_tag()``; collectives and copies launched through the
  primitives declare their ``reads`` / ``writes`` and belong to the stream they were launched on,
  at launch time (their internal ops and anything run on other threads are not looked at);
- a read of a tensor whose last write came from another stream, or a write of a tensor last read
  or written on another stream, without an ordering edge in between, is a race.

Tensors are identified by their storage (device, ``untyped_storage().data_ptr()``). A storage
freed and reused at the same address is forgotten conservatively: every operation that returns a
new tensor (not a view of an input) starts a fresh history for its storage, and the ``empty``
family only allocates, it does not count as a write.

Use ``with Sanitizer():`` (raises `StreamRaceError` on the first race; ``raise_on_race=False``
collects them in ``.races`` and logs them), or set ``OVERLAP_SANITIZE=1`` (log races) or
``OVERLAP_SANITIZE=raise`` and call `enable_from_env` (``overlap.sanitize_from_env()``; the launcher,
the benchmarks, `overlap.multirank.run_ranks` and the test suite do).
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import hooks
from ..context import current_stream_tag
from ..hooks import Span
from ..state import STATE

ENV_SANITIZE = "OVERLAP_SANITIZE"
log = logging.getLogger(__name__)

_ALLOCATORS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_StorageKey = Tuple[str, int]
Clock = Dict[str, int]


@dataclasses.dataclass(frozen=True)
class Access:
    """One access to a tensor: which stream, the stream's sequence number then, and which operation.

    ``lo``/``hi`` are the bytes of the storage it touched (for a stream's latest accesses, the union
    of the bytes they touched), so disjoint parts of one buffer written from two streams are not a race.
    """

    stream: str
    seq: int
    op: str
    lo: int = 0
    hi: int = 1 << 62

    def overlaps(self, other: "Access") -> bool:
        return self.lo < other.hi and other.lo < self.hi

    def covers(self, other: "Access") -> bool:
        return self.lo <= other.lo and other.hi <= self.hi

    def merged(self, older: Optional["Access"]) -> "Access":
        """This access, also covering the bytes of an older access of the same stream."""
        if older is None:
            return self
        return dataclasses.replace(self, lo=min(self.lo, older.lo), hi=max(self.hi, older.hi))


@dataclasses.dataclass(frozen=True)
class Race:
    """Two unordered accesses to one tensor from different streams."""

    kind: str  # "read after write", "write after read" or "write after write"
    previous: Access
    current: Access
    shape: Tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        first, then = self.kind.split(" after ")[::-1]
        return (f"stream race ({self.kind}) on a tensor of shape {tuple(self.shape)} {self.dtype}: "
                f"{first} by {self.previous.op!r} on stream {self.previous.stream!r}, then {then} by "
                f"{self.current.op!r} on stream {self.current.stream!r} with no event wait (or "
                f"synchronize) ordering them; record an event after the first and wait on it before the second")


class StreamRaceError(RuntimeError):
    """Raised by a `Sanitizer` in test mode on the first race."""

    def __init__(self, race: Race):
        super().__init__(str(race))
        self.race = race


_MAX_EVENTS = 1 << 16  # recorded events remembered; the oldest are forgotten first


@dataclasses.dataclass
class _History:
    writes: Dict[str, Access] = dataclasses.field(default_factory=dict)  # latest write per stream
    reads: Dict[str, Access] = dataclasses.field(default_factory=dict)  # latest read per stream
    storage: Any = None  # a weak reference to the storage this history is about

    def stale(self) -> bool:
        """The storage was freed: its address may now hold an unrelated tensor (e.g. from torch.tensor)."""
        return self.storage is not None and self.storage.expired()


def _weak_storage(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _byte_range(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage that ``t`` spans (from its first to its last element)."""
    size = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    lo = t.storage_offset() * size
    return lo, lo + (last + 1) * size


def _storage_key(t: torch.Tensor) -> Optional[_StorageKey]:
    try:
        if t.device.type == "meta" or t.numel() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # fake, sparse or functional tensors
        return None
    return (str(t.device), ptr) if ptr else None


def _tensors(value: Any) -> List[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


class _Mode(TorchDispatchMode):
    def __init__(self, sanitizer: "Sanitizer"):
        super().__init__()
        self.sanitizer = sanitizer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pending = self.sanitizer._before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if pending is not None:
            self.sanitizer._after_op(pending, out)
        return out


class Sanitizer:
    """Context manager that checks stream ordering while active; see the module docstring."""

    def __init__(self, raise_on_race: bool = True, log_races: bool = True):
        self.raise_on_race = raise_on_race
        self.log_races = log_races
        self.races: List[Race] = []
        self._seen: Set[Tuple[str, str, str, str, str]] = set()
        self._clocks: Dict[str, Clock] = {}
        self._host: Clock = {}  # what the host has waited for; every later launch is ordered after it
        self._events: "collections.OrderedDict[str, Clock]" = collections.OrderedDict()
        self._history: Dict[_StorageKey, _History] = {}
        self._lock = threading.RLock()
        self._local = threading.local()
        self._mode: Optional[_Mode] = None
        self._owner: Optional[int] = None

    # lifecycle
    def __enter__(self) -> "Sanitizer":
        self._owner = threading.get_ident()
        hooks.add_observer(self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            hooks.remove_observer(self)

    # clocks
    def _clock(self, stream: str) -> Clock:
        c = self._clocks.get(stream)
        if c is None:
            c = self._clocks[stream] = {stream: 0}
        _merge(c, self._host)
        return c

    def _tick(self, stream: str) -> int:
        c = self._clock(stream)
        c[stream] = c.get(stream, 0) + 1
        return c[stream]

    # the core check
    def _access(self, stream: str, op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
                fresh: Sequence[torch.Tensor] = ()) -> None:
        with self._lock:
            seq = self._tick(stream)
            now = self._clocks[stream]

            def unordered(a: Access) -> bool:
                return a.stream != stream and a.seq > now.get(a.stream, 0)

            accesses = [(t, k, True) for t in writes if (k := _storage_key(t)) is not None]
            accesses += [(t, k, False) for t in reads if (k := _storage_key(t)) is not None]
            for t, key, is_write in accesses:
                me = Access(stream, seq, op, *_byte_range(t))
                h = self._history.get(key)
                if h is not None and h.stale():
                    h = None
                if h is None:
                    h = self._history[key] = _History(storage=_weak_storage(t))
                for w in h.writes.values():
                    if unordered(w) and w.overlaps(me):
                        self._report("write after write" if is_write else "read after write", w, me, t)
                if is_write:
                    for r in h.reads.values():
                        if unordered(r) and r.overlaps(me):
                            self._report("write after read", r, me, t)
                    # accesses this write orders after and overwrites are history
                    for d in (h.writes, h.reads):
                        for s_, a in list(d.items()):
                            if s_ != stream and not unordered(a) and me.covers(a):
                                del d[s_]
                    h.writes[stream] = me.merged(h.writes.get(stream))
                else:
                    h.reads[stream] = me.merged(h.reads.get(stream))
            for t in fresh:
                key = _storage_key(t)
                if key is not None:
                    self._history[key] = _History({stream: Access(stream, seq, op, *_byte_range(t))},
                                                  storage=_weak_storage(t))

    def _report(self, kind: str, previous: Access, current: Access, t: torch.Tensor) -> None:
        race = Race(kind, previous, current, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        sig = (kind, previous.stream, previous.op, current.stream, current.op)
        if sig not in self._seen:
            self._seen.add(sig)
            self.races.append(race)
            if self.log_races and not self.raise_on_race:
                log.warning("%s", race)
        if self.raise_on_race:
            raise StreamRaceError(race)

    # TorchDispatchMode side
    def _suppressed(self) -> Set[int]:
        s = getattr(self._local, "open", None)
        if s is None:
            s = self._local.open = set()
        return s

    def _before_op(self, func: Any, args: Any, kwargs: Any) -> Any:
        if threading.get_ident() != self._owner or self._suppressed():
            return None
        if func.namespace == "c10d":  # a collective's own ops: seen through its span instead
            return None
        schema = func._schema
        name = func.overloadpacket.__name__
        if name in _ALLOCATORS:
            return ("alloc",)
        if any(r.alias_info is not None for r in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return None  # a view: metadata only, no data is touched
        reads: List[torch.Tensor] = []
        writes: List[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                continue
            tensors = _tensors(value)
            (writes if arg.alias_info is not None and arg.alias_info.is_write else reads).extend(tensors)
        stream = current_stream_tag()
        op = str(func.overloadpacket)
        self._access(stream, op, reads, writes)
        return (stream, op)

    def _after_op(self, pending: Any, out: Any) -> None:
        fresh = _tensors(out)
        if pending[0] == "alloc":
            with self._lock:
                for t in fresh:
                    key = _storage_key(t)
                    if key is not None:
                        self._history.pop(key, None)
            return
        stream, op = pending
        with self._lock:
            seq = self._clocks[stream][stream]
            for t in fresh:
                key = _storage_key(t)
                h = self._history.get(key) if key is not None else None
                mine = h.writes.get(stream) if h is not None else None
                # a new tensor: forget whatever this address held before (freed and reused)
                if key is not None and (mine is None or mine.seq != seq):
                    self._history[key] = _History({stream: Access(stream, seq, op, *_byte_range(t))},
                                                  storage=_weak_storage(t))

    # hooks observer
    def on_span_start(self, span: Span) -> None:
        if not (span.reads or span.writes):
            return
        if not span.asynchronous:
            self._suppressed().add(span.id)  # its inline ops (e.g. the copy itself) are this span
        try:
            self._access(span.stream, span.name, span.reads, span.writes)
        except StreamRaceError:
            self._suppressed().discard(span.id)
            raise

    def on_span_end(self, span: Span) -> None:
        s = getattr(self._local, "open", None)
        if s:
            s.discard(span.id)

    def on_event_record(self, name: str, stream: str) -> None:
        with self._lock:
            self._events[name] = dict(self._clock(stream))
            self._events.move_to_end(name)
            if len(self._events) > _MAX_EVENTS:  # per-call events (dispatch handles) never repeat a name
                self._events.popitem(last=False)

    def on_event_wait(self, name: str, stream: str) -> None:
        with self._lock:
            ev = self._events.get(name)
            if ev is not None:
                _merge(self._clock(stream), ev)

    def on_event_synchronize(self, name: str) -> None:
        with self._lock:
            ev = self._events.get(name)
            if ev is not None:
                _merge(self._host, ev)

    def on_synchronize(self) -> None:
        with self._lock:
            for c in self._clocks.values():
                _merge(self._host, c)

    def report(self) -> str:
        """The races found so far, one per line ("no stream races" when clean)."""
        return "\n".join(map(str, self.races)) or "no stream races"


def enable_from_env() -> Optional[Sanitizer]:
    """Start a process-wide sanitizer when ``$OVERLAP_SANITIZE`` asks for one (idempotent).

    ``1`` / ``warn`` logs each race and prints a summary at exit; ``raise`` raises on the first.
    The dispatch mode is entered on the calling thread, which should be the one launching work.
    """
    value = os.environ.get(ENV_SANITIZE, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return None
    if value not in ("1", "true", "on", "yes", "warn", "raise"):
        raise ValueError(f"${ENV_SANITIZE}={value!r}: expected 0, 1, warn or raise")
    with STATE.lock:
        if STATE.sanitizer is None:
            san = STATE.sanitizer = Sanitizer(raise_on_race=value == "raise").__enter__()
            atexit.register(lambda: san.races and log.warning(
                "overlap sanitizer: %d stream race(s)\n%s", len(san.races), san.report()))
        return STATE.sanitizer
