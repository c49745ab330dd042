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

A race report names the Python stack of both accesses. The stack is captured when an access is
recorded, by walking ``sys._getframe`` up to `_STACK_DEPTH` frames outside this module,
``overlap.hooks`` and torch, without reading source lines (those are read only when a race is
printed): a few microseconds per tracked operation, on top of the dispatch mode's own cost.

The parts, one job each: `_StreamClocks` (vector clocks and ordering edges), `_TensorsAccessed`
(per storage, the latest accesses of each stream), `_ArgumentHandler` (what an aten operation reads
and writes), `_DispatchMode` (hands operations to the sanitizer) and `Sanitizer` (puts them
together, observes the hooks, reports).

Use ``with Sanitizer():`` (raises `StreamRaceError` on the first race; ``raise_on_race=False``
collects them in ``.races`` and logs them), or set ``OVERLAP_SANITIZE=1`` (log races) or
``OVERLAP_SANITIZE=raise`` and call `enable_from_env` (``overlap.sanitize_from_env()``; the launcher,
the benchmarks, `overlap.multirank.run_ranks` and the test suite do).
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import hooks
from ..context import OFF_WORDS, ON_WORDS, current_stream_tag
from ..hooks import Span
from ..state import STATE

ENV_SANITIZE = "OVERLAP_SANITIZE"
log = logging.getLogger(__name__)

_ALLOCATORS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_MAX_EVENTS = 1 << 16  # recorded events remembered; the oldest are forgotten first
_STACK_DEPTH = 5  # user frames kept per access
_StorageKey = Tuple[str, int]
Clock = Dict[str, int]
Stack = Tuple[traceback.FrameSummary, ...]


# stacks

_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(hooks.__file__)}
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@functools.lru_cache(maxsize=None)
def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path in _SKIPPED_FILES or path.startswith(_TORCH_DIR)


def _user_stack(depth: int = _STACK_DEPTH) -> Stack:
    """The caller's innermost ``depth`` frames outside the sanitizer, the hooks and torch, outermost first."""
    frames: List[traceback.FrameSummary] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < depth:
        code = f.f_code
        if not _is_internal(code.co_filename):
            frames.append(traceback.FrameSummary(code.co_filename, f.f_lineno, code.co_name, lookup_line=False))
        f = f.f_back
    return tuple(reversed(frames))


# what is reported

@dataclasses.dataclass(frozen=True)
class Access:
    """One access to a tensor: which stream, the stream's sequence number then, and which operation.

    ``lo``/``hi`` are the bytes of the storage it touched (for a stream's latest accesses, the union
    of the bytes they touched), so disjoint parts of one buffer written from two streams are not a race.
    ``stack`` is the Python stack that made the access (outermost first, a few user frames).
    """

    stream: str
    seq: int
    op: str
    lo: int = 0
    hi: int = 1 << 62
    stack: Stack = dataclasses.field(default=(), compare=False, repr=False)

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
    """Two unordered accesses to one tensor from different streams (each with its stack)."""

    kind: str  # "read after write", "write after read" or "write after write"
    previous: Access
    current: Access
    shape: Tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        first, then = self.kind.split(" after ")[::-1]
        lines = [f"stream race ({self.kind}) on a tensor of shape {tuple(self.shape)} {self.dtype}: "
                 f"{first} by {self.previous.op!r} on stream {self.previous.stream!r}, then {then} by "
                 f"{self.current.op!r} on stream {self.current.stream!r} with no event wait (or "
                 f"synchronize) ordering them; record an event after the first and wait on it before the second"]
        for what, access in ((first, self.previous), (then, self.current)):
            if access.stack:
                lines.append(f"  {what} by {access.op!r} on stream {access.stream!r} at:")
                formatted = "".join(traceback.StackSummary.from_list(access.stack).format())
                lines.extend("  " + line for line in formatted.splitlines())
        return "\n".join(lines)


class StreamRaceError(RuntimeError):
    """Raised by a `Sanitizer` in test mode on the first race."""

    def __init__(self, race: Race):
        super().__init__(str(race))
        self.race = race


# vector clocks

def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


class _StreamClocks:
    """A vector clock per stream and the edges that order streams: events and host synchronisation.

    Not locked: the `Sanitizer` holds its lock around every call.
    """

    def __init__(self, max_events: int = _MAX_EVENTS):
        self._clocks: Dict[str, Clock] = {}
        self._host: Clock = {}  # what the host has waited for; every later launch is ordered after it
        self._events: "collections.OrderedDict[str, Clock]" = collections.OrderedDict()
        self._max_events = max_events

    def clock(self, stream: str) -> Clock:
        """The stream's clock, caught up with what the host has waited for."""
        c = self._clocks.get(stream)
        if c is None:
            c = self._clocks[stream] = {stream: 0}
        _merge(c, self._host)
        return c

    def tick(self, stream: str) -> int:
        """Start a new operation on the stream; its sequence number there."""
        c = self.clock(stream)
        c[stream] = c.get(stream, 0) + 1
        return c[stream]

    def ordered_before(self, access: Access, stream: str) -> bool:
        """Whether ``access`` happened before the stream's latest operation (same stream, or an edge since)."""
        return access.stream == stream or access.seq <= self._clocks[stream].get(access.stream, 0)

    def record(self, event: str, stream: str) -> None:
        self._events[event] = dict(self.clock(stream))
        self._events.move_to_end(event)
        if len(self._events) > self._max_events:  # per-call events (dispatch handles) never repeat a name
            self._events.popitem(last=False)

    def wait(self, event: str, stream: str) -> None:
        ev = self._events.get(event)
        if ev is not None:
            _merge(self.clock(stream), ev)

    def host_wait(self, event: str) -> None:
        ev = self._events.get(event)
        if ev is not None:
            _merge(self._host, ev)

    def host_wait_all(self) -> None:
        for c in self._clocks.values():
            _merge(self._host, c)


# tensor access history

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


def _access_to(t: torch.Tensor, stream: str, seq: int, op: str, stack: Stack) -> Access:
    return Access(stream, seq, op, *_byte_range(t), stack=stack)


@dataclasses.dataclass
class _History:
    writes: Dict[str, Access] = dataclasses.field(default_factory=dict)  # latest write per stream
    reads: Dict[str, Access] = dataclasses.field(default_factory=dict)  # latest read per stream
    storage: Any = None  # a weak reference to the storage this history is about

    def stale(self) -> bool:
        """The storage was freed: its address may now hold an unrelated tensor (e.g. from torch.tensor)."""
        return self.storage is not None and self.storage.expired()


class _TensorsAccessed:
    """Per storage, the latest write and the latest read of each stream, with their byte ranges.

    ``ordered(access)`` says whether an earlier access happened before the one being checked.
    Not locked: the `Sanitizer` holds its lock around every call.
    """

    def __init__(self) -> None:
        self.storages: Dict[_StorageKey, _History] = {}

    def entry(self, key: _StorageKey, t: torch.Tensor) -> _History:
        """The history of ``t``'s storage: a new one when there is none or its storage was freed."""
        h = self.storages.get(key)
        if h is None or h.stale():
            h = self.storages[key] = _History(storage=_weak_storage(t))
        return h

    @staticmethod
    def conflicts(h: _History, me: Access, is_write: bool,
                  ordered: Callable[[Access], bool]) -> List[Tuple[str, Access]]:
        """The earlier accesses that ``me`` races with, each with the kind of race."""
        found = [("write after write" if is_write else "read after write", w)
                 for w in h.writes.values() if not ordered(w) and w.overlaps(me)]
        if is_write:
            found += [("write after read", r) for r in h.reads.values() if not ordered(r) and r.overlaps(me)]
        return found

    @staticmethod
    def record(h: _History, me: Access, is_write: bool, ordered: Callable[[Access], bool]) -> None:
        if not is_write:
            h.reads[me.stream] = me.merged(h.reads.get(me.stream))
            return
        # what this write is ordered after and overwrites is no longer needed
        for d in (h.writes, h.reads):
            for stream, a in list(d.items()):
                if stream != me.stream and ordered(a) and me.covers(a):
                    del d[stream]
        h.writes[me.stream] = me.merged(h.writes.get(me.stream))

    def allocated(self, t: torch.Tensor) -> None:
        """``t`` was just allocated (not written): whatever its address held before is forgotten."""
        key = _storage_key(t)
        if key is not None:
            self.storages.pop(key, None)

    def returned(self, t: torch.Tensor, me: Access) -> None:
        """``t`` was returned by the operation ``me``: unless it wrote ``t`` in place, ``t`` is new memory."""
        key = _storage_key(t)
        if key is None:
            return
        h = self.storages.get(key)
        mine = h.writes.get(me.stream) if h is not None else None
        if mine is None or mine.seq != me.seq:  # forget what a freed tensor at this address did
            self.storages[key] = _History({me.stream: me}, storage=_weak_storage(t))


# aten operations

def _tensor_leaves(value: Any) -> List[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


@dataclasses.dataclass(frozen=True)
class _OpTensors:
    """What one aten operation touches: the tensors it reads and writes, or that it only allocates."""

    op: str
    reads: Tuple[torch.Tensor, ...] = ()
    writes: Tuple[torch.Tensor, ...] = ()
    allocates: bool = False


class _ArgumentHandler:
    """Reads an aten operation's schema and arguments: which tensors it reads, which it writes."""

    @staticmethod
    def parse(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[_OpTensors]:
        """None when the operation touches no data to check (a view, or a collective's own ops)."""
        if func.namespace == "c10d":  # seen through the collective's span instead
            return None
        op = str(func.overloadpacket)
        if func.overloadpacket.__name__ in _ALLOCATORS:
            return _OpTensors(op, allocates=True)
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return None  # a view: metadata only
        reads: List[torch.Tensor] = []
        writes: List[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                continue
            written = arg.alias_info is not None and arg.alias_info.is_write
            (writes if written else reads).extend(_tensor_leaves(value))
        return _OpTensors(op, tuple(reads), tuple(writes))


class _DispatchMode(TorchDispatchMode):
    """Shows the sanitizer every aten operation before and after it runs."""

    def __init__(self, sanitizer: "Sanitizer"):
        super().__init__()
        self.sanitizer = sanitizer

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap ``__torch_dispatch__`` in `torch._disable_dynamo`, whose first call imports
        Dynamo (over a second of CPU in a process that never compiles); `__torch_dispatch__` disables it itself,
        and only where Dynamo is loaded: without it, no frame can be compiled."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "torch._dynamo" in sys.modules:
            return _dispatch_without_dynamo(self, func, args, kwargs)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        kwargs = kwargs or {}
        pending = self.sanitizer._before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if pending is not None:
            self.sanitizer._after_op(pending, out)
        return out


_dispatch_without_dynamo = torch._disable_dynamo(_DispatchMode._dispatch, recursive=True)


_ALLOCATION = "allocation"  # what _before_op hands _after_op for an allocator


class Sanitizer:
    """Context manager that checks stream ordering while active; see the module docstring."""

    def __init__(self, raise_on_race: bool = True, log_races: bool = True):
        self.raise_on_race = raise_on_race
        self.log_races = log_races
        self.races: List[Race] = []
        self._seen: Set[Tuple[str, str, str, str, str]] = set()
        self._clocks = _StreamClocks()
        self._accessed = _TensorsAccessed()
        self._arguments = _ArgumentHandler()
        self._lock = threading.RLock()
        self._local = threading.local()
        self._mode: Optional[_DispatchMode] = None
        self._owner: Optional[int] = None

    @property
    def _history(self) -> Dict[_StorageKey, _History]:
        """The access history per storage key."""
        return self._accessed.storages

    # lifecycle
    def __enter__(self) -> "Sanitizer":
        self._owner = threading.get_ident()
        hooks.add_observer(self)
        self._mode = _DispatchMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            hooks.remove_observer(self)

    # the core check
    def _access(self, stream: str, op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
                stack: Optional[Stack] = None) -> int:
        """Check one operation's accesses on ``stream`` and record them; its sequence number there."""
        if stack is None:
            stack = _user_stack()
        with self._lock:
            seq = self._clocks.tick(stream)

            def ordered(a: Access) -> bool:
                return self._clocks.ordered_before(a, stream)

            touched = [(t, k, True) for t in writes if (k := _storage_key(t)) is not None]
            touched += [(t, k, False) for t in reads if (k := _storage_key(t)) is not None]
            for t, key, is_write in touched:
                me = _access_to(t, stream, seq, op, stack)
                h = self._accessed.entry(key, t)
                for kind, previous in self._accessed.conflicts(h, me, is_write, ordered):
                    self._report(kind, previous, me, t)
                self._accessed.record(h, me, is_write, ordered)
        return seq

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

    # dispatch mode side
    def _suppressed(self) -> Set[int]:
        s = getattr(self._local, "open", None)
        if s is None:
            s = self._local.open = set()
        return s

    def _before_op(self, func: Any, args: Any, kwargs: Any) -> Union[None, str, Access]:
        if threading.get_ident() != self._owner or self._suppressed():
            return None
        touched = self._arguments.parse(func, args, kwargs)
        if touched is None:
            return None
        if touched.allocates:
            return _ALLOCATION
        stack = _user_stack()
        stream = current_stream_tag()
        seq = self._access(stream, touched.op, touched.reads, touched.writes, stack)
        return Access(stream, seq, touched.op, stack=stack)

    def _after_op(self, pending: Union[str, Access], out: Any) -> None:
        with self._lock:
            for t in _tensor_leaves(out):
                if isinstance(pending, Access):
                    self._accessed.returned(t, _access_to(t, pending.stream, pending.seq, pending.op, pending.stack))
                else:
                    self._accessed.allocated(t)

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
            self._clocks.record(name, stream)

    def on_event_wait(self, name: str, stream: str) -> None:
        with self._lock:
            self._clocks.wait(name, stream)

    def on_event_synchronize(self, name: str) -> None:
        with self._lock:
            self._clocks.host_wait(name)

    def on_synchronize(self) -> None:
        with self._lock:
            self._clocks.host_wait_all()

    def report(self) -> str:
        """The races found so far, each with the stacks of its two accesses ("no stream races" when clean)."""
        return "\n".join(map(str, self.races)) or "no stream races"


def env_mode() -> Optional[str]:
    """What ``$OVERLAP_SANITIZE`` asks for: None (unset, 0, false, off, no), ``"warn"`` (1, true, on, yes,
    warn) or ``"raise"``; ValueError naming the variable for anything else."""
    raw = os.environ.get(ENV_SANITIZE, "")
    value = raw.strip().lower()
    if value in ("",) + OFF_WORDS:
        return None
    if value in ON_WORDS + ("warn",):
        return "warn"
    if value == "raise":
        return "raise"
    raise ValueError(f"${ENV_SANITIZE}={raw!r}: expected 0, 1, warn or raise")


def enable_from_env() -> Optional[Sanitizer]:
    """Start a process-wide sanitizer when ``$OVERLAP_SANITIZE`` asks for one (idempotent).

    ``1`` / ``warn`` logs each race and prints a summary at exit; ``raise`` raises on the first.
    The dispatch mode is entered on the calling thread, which should be the one launching work.
    """
    mode = env_mode()
    if mode is None:
        return None
    with STATE.lock:
        if STATE.sanitizer is None:
            san = STATE.sanitizer = Sanitizer(raise_on_race=mode == "raise").__enter__()
            atexit.register(lambda: san.races and log.warning(
                "overlap sanitizer: %d stream race(s)\n%s", len(san.races), san.report()))
        return STATE.sanitizer
