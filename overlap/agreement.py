"""Ranks that must agree check that they do: every rank's values, or the same error on every rank.

Wherever the ranks of a job must hold the same thing or take the same decision (the launcher's
job, a calibration's structure, the micro-batch split, an expert-parallel layer's shapes, a
capacity, MC2's bound), each rank *posts* its named values and its problems, a *transport* brings
every rank's post to every rank, and `compare_posts` reads them: agreed when every value is equal
on every rank that posts it (the names in ``per_rank`` are each rank's own, gathered and not
compared: a token count) and no rank has a problem; otherwise one message, the problems rank by
rank, then each value that differs with each rank's value (``nothing`` where a rank without a
problem did not post it)::

    ranks disagree on num_experts: rank 0: 8; rank 1: 4

`agree` does the three steps and returns every rank's values; `agree_later` starts the exchange and
reads it when asked (`PendingAgreement.result`), so that a caller goes on while its post travels.
Every rank raises alike: ``error``
(`Disagreement` by default, or the class a place's users catch: `LayoutError`, `JobMismatch`)
with that message, built from the same posts on every rank; only a rank that passes its own
exception (``own_error``: the input it rejected) raises that one, the precise message for its
input, while the others name it. Values compare as JSON does, NaN equal to NaN (a NaN on one
rank and a number on another is a difference, shown as ``nan``).

A reduction is not an agreement: where a place takes the largest micro-batch count every rank
offers, or the element-wise maximum of the calibrations, it computes it from the values `agree`
returns, or in its own all-reduce once `agree` has checked that the numbers line up.

Transports, each waiting a bounded time:

- `GroupTransport`: one all-reduce of a fixed-size tensor over a process group: each rank's post,
  as JSON, in its own row of ``[world, _WORDS]`` int64 (zeros elsewhere, MAX-reduced: an
  all-gather). Its size never depends on what a rank posts, so ranks that disagree cannot make
  gloo abort or hang on a size mismatch; a post too long for its row is shortened (long values to
  a digest that still compares, problems clipped). Without peers it is local. With a ``stream``
  its `issue` sends the all-reduce on that side stream and reads it later: on the CPU path gloo
  completes it on its own threads, on a device the side stream runs it beside the caller's work.
- `StoreTransport`: the rendezvous store (torchrun's), before any collective exists; it waits at
  most ``timeout`` seconds and names the ranks that did not post.

Where the values ride on an exchange that happens anyway (the dispatch's count exchange), that
exchange builds the posts from what it received and calls `compare_posts`: no extra collective.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import time
import zlib
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Protocol, Sequence, Type

import torch
import torch.distributed as dist

from . import backends
from .comm import all_reduce, collective_device
from .events import Event
from .streams import stream

Post = Dict[str, Any]  # one rank's post: {"values": {name: value}, "problems": [words]}

_WORDS = 147  # one rank's row: its post's length in bytes, then 7 bytes of JSON per int64 (never negative)
_BYTES = 7 * (_WORDS - 1)
_HEADER = "the ranks cannot go on together:"


class Disagreement(ValueError):
    """Ranks that must agree do not, or one of them cannot go on; raised alike on every rank (`agree`)."""


class Transport(Protocol):
    """What brings every rank's post to every rank."""

    def exchange(self, post: Post, error: Type[Exception]) -> List[Post]:
        """Every rank's post (JSON-decoded), in rank order, this rank's included; ``error`` naming the ranks
        that did not take part in time."""


def agree(values: Mapping[str, Any], transport: Transport, *, problems: Sequence[str] = (),
          own_error: Optional[BaseException] = None, per_rank: Collection[str] = (),
          hints: Optional[Mapping[str, str]] = None, error: Type[Exception] = Disagreement,
          problem_error: Optional[Type[Exception]] = None) -> List[Dict[str, Any]]:
    """Every rank's ``values`` (rank order, as JSON gives them back), once every rank agrees.

    ``values``: this rank's named values (JSON-able; anything else travels as its ``str``), equal on
    every rank but those named in ``per_rank``. ``problems``: this rank's problems, in words.
    ``own_error``: the exception this rank raises once every rank has heard of it (its words travel
    as ``"Type: message"`` unless ``problems`` says it). ``hints``: what to do, by value name, added
    to the line of a value that differs. Raises ``error`` with one message on every rank (see the
    module docstring), ``problem_error`` instead where a rank reported a problem (when given), or
    ``own_error`` on its rank.
    """
    words = [str(p) for p in problems]
    if own_error is not None and not words:
        words = [f"{type(own_error).__name__}: {own_error}"]
    posts = transport.exchange({"values": dict(values), "problems": words}, error)
    if own_error is not None:
        raise own_error
    compare_posts(posts, per_rank=per_rank, hints=hints, error=error, problem_error=problem_error)
    return [dict(p["values"]) for p in posts]


class PendingAgreement:
    """An agreement whose exchange is in flight (`agree_later`)."""

    def __init__(self, read: Callable[[], List[Post]], check: Callable[[List[Post]], None]):
        self._read, self._check = read, check
        self._posts: Optional[List[Post]] = None

    def result(self) -> List[Dict[str, Any]]:
        """What `agree` returns (every rank's values), or its error, the same on every rank; waits for the
        exchange at most the wait bound (`overlap.set_wait_timeout`) the first time, and gives the same answer
        every time after."""
        if self._posts is None:
            self._posts = self._read()
        self._check(self._posts)
        return [dict(p["values"]) for p in self._posts]


def agree_later(values: Mapping[str, Any], transport: Transport, *, problems: Sequence[str] = (),
                per_rank: Collection[str] = (), hints: Optional[Mapping[str, str]] = None,
                error: Type[Exception] = Disagreement, problem_error: Optional[Type[Exception]] = None
                ) -> PendingAgreement:
    """`agree`, its exchange started now and read by `PendingAgreement.result`: through ``transport``'s `issue`
    where it has one (`GroupTransport`, on its ``stream``: the caller goes on while the post travels), else its
    `exchange`, at once. Every rank must start the same agreements in the same order, and read each one."""
    post = {"values": dict(values), "problems": [str(p) for p in problems]}
    issue = getattr(transport, "issue", None)
    if issue is not None:
        read = issue(post, error)
    else:
        posts = transport.exchange(post, error)
        read = lambda: posts  # noqa: E731 - already exchanged
    return PendingAgreement(read, lambda posts: compare_posts(posts, per_rank=per_rank, hints=hints, error=error,
                                                              problem_error=problem_error))


def compare_posts(posts: Sequence[Post], *, per_rank: Collection[str] = (),
                  hints: Optional[Mapping[str, str]] = None, error: Type[Exception] = Disagreement,
                  problem_error: Optional[Type[Exception]] = None) -> None:
    """Raise ``error`` naming every problem and every value that differs in ``posts`` (every rank's, in rank
    order; see `agree`), or nothing when they agree; ``problem_error`` instead, when given, where a rank
    reported a problem. Pure: the same posts give the same message on every rank."""
    problems = _problem_lines(posts)
    lines = problems + _difference_lines(posts, set(per_rank), hints or {})
    if lines:
        kind = problem_error if problems and problem_error is not None else error
        raise kind(lines[0] if len(lines) == 1 else _HEADER + "\n  " + "\n  ".join(lines))


def _rank_words(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0, 1`` or ``ranks 0-2, 5``."""
    spans: List[List[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    parts = []
    for a, b in spans:
        parts += [f"{a}-{b}"] if b - a > 1 else [str(r) for r in range(a, b + 1)]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"


def _problem_lines(posts: Sequence[Post]) -> List[str]:
    """Each problem once, with the ranks that have it, in the order of the first rank to have it."""
    by_words: Dict[str, List[int]] = {}
    for rank, post in enumerate(posts):
        for words in post.get("problems", []):
            holders = by_words.setdefault(words, [])
            if rank not in holders:
                holders.append(rank)
    return [f"{_rank_words(ranks)}: {words}" for words, ranks in by_words.items()]


class _Nothing:
    """The value of a name a rank did not post."""

    def __repr__(self) -> str:
        return "nothing"


_NOTHING = _Nothing()


def _difference_lines(posts: Sequence[Post], per_rank: Collection[str], hints: Mapping[str, str]) -> List[str]:
    """One line per value that differs between the ranks, each distinct value with its ranks. A rank with a
    problem is named for it: a value it did not post (it failed before it knew it) is not held against it."""
    names: Dict[str, None] = {}
    for post in posts:
        names.update(dict.fromkeys(k for k in post.get("values", {}) if k not in per_rank))
    lines = []
    for name in names:
        groups: List[List[Any]] = []  # [value, its ranks]
        for rank, post in enumerate(posts):
            value = post.get("values", {}).get(name, _NOTHING)
            if value is _NOTHING and post.get("problems"):
                continue
            same = next((g for g in groups if _same(g[0], value)), None)
            if same is None:
                groups.append([value, [rank]])
            else:
                same[1].append(rank)
        if len(groups) > 1:
            line = f"ranks disagree on {name}: " + "; ".join(f"{_rank_words(r)}: {v!r}" for v, r in groups)
            lines.append(line + (f"; {hints[name]}" if hints.get(name) else ""))
    return lines


def _same(a: Any, b: Any) -> bool:
    """Equal as values (``1 == 1.0``), NaN equal to NaN, at any depth."""
    if a is _NOTHING or b is _NOTHING:
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        if a == b:
            return True
    except Exception:  # noqa: BLE001 - a value without a plain comparison: its JSON decides
        pass
    return _dumps(a) == _dumps(b)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, default=str).encode()


# ---- the transports ----------------------------------------------------------------------------------------

class GroupTransport:
    """One all-reduce of a fixed-size tensor over ``group`` (default: the default group), named and labelled
    ``name`` on the timeline, read on the host; local without peers. ``device``: where the tensor lives (default:
    the group's collective device). ``stream``: the side stream `issue` sends it on (default: the current
    stream, where `issue` waits as `exchange` does)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, name: str = "agree",
                 device: Optional[torch.device] = None, stream: Optional[str] = None):
        self.group, self.name, self.device, self.stream = group, name, device, stream

    def exchange(self, post: Post, error: Type[Exception]) -> List[Post]:
        return self.issue(post, error)()

    def issue(self, post: Post, error: Type[Exception]) -> Callable[[], List[Post]]:
        """Send ``post`` now (on ``stream``, where the path has side streams outside a graph) and return what
        reads every rank's post, waiting for the all-reduce at most the wait bound."""
        data = _fitted(post, _BYTES)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) < 2:
            alone = [json.loads(data)]
            return lambda: alone
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        device = self.device or collective_device(self.group)
        aside = self.stream is not None and not backends.current().is_graph
        with stream(self.stream) if aside else contextlib.nullcontext():
            rows = torch.zeros(world, _WORDS, dtype=torch.int64, device=device)
            rows[rank] = torch.tensor(_packed(data), dtype=torch.int64, device=device)
            all_reduce(rows, op=dist.ReduceOp.MAX, group=self.group, name=self.name, label=self.name)
            done = _recorded(rows, f"{self.name}.read")
        return lambda: [json.loads(_unpacked(row)) for row in _host_read(rows, done)]


class StoreTransport:
    """The rendezvous store ``store`` (no collective): this rank sets its post under ``key/rank`` and waits
    at most ``timeout`` seconds for the ``world`` ranks' posts; on time out ``error`` says which ranks did
    not ``late`` (e.g. ``"reach the start of the job within --timeout 5 s"``)."""

    def __init__(self, store: dist.Store, key: str, rank: int, world: int, timeout: float, late: str):
        self.store, self.key, self.rank, self.world, self.timeout, self.late = store, key, rank, world, timeout, late

    def exchange(self, post: Post, error: Type[Exception]) -> List[Post]:
        keys = [f"{self.key}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], _dumps(post))
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001 - the store's time-out; its type varies with the torch version
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if missing:
                raise error(f"{_rank_words(missing)} did not {self.late}") from None
        posts = [json.loads(self.store.get(k)) for k in keys]
        self._read_by_all()
        return posts

    def _read_by_all(self) -> None:
        """Count this rank's reading; rank 0 returns once every rank has read (at most ``timeout`` s): with ranks
        started by hand rank 0's process holds the store, and leaving at once on a disagreement every rank found
        cut the others' reading short ("Connection reset by peer", exit 1 instead of the agreement's 2)."""
        read = f"{self.key}/read"
        count = self.store.add(read, 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + self.timeout
        while count < self.world and time.monotonic() < deadline:
            time.sleep(0.002)
            count = self.store.add(read, 0)


def _fitted(post: Post, limit: int) -> bytes:
    """``post`` as JSON of at most ``limit`` bytes: as it is; else long values as a digest (equal values keep
    equal digests) and problems clipped; else one problem saying that it does not fit."""
    data = _dumps(post)
    for clip in (240, 80):
        if len(data) <= limit:
            return data
        data = _dumps({"values": {k: _digest(v) for k, v in post["values"].items()},
                       "problems": [p if len(p) <= clip else p[:clip - 3] + "..." for p in post["problems"]]})
    if len(data) <= limit:
        return data
    return _dumps({"values": {}, "problems": [f"its post ({len(_dumps(post))} bytes: {len(post['values'])} values, "
                                              f"{len(post['problems'])} problems) does not fit the {limit} bytes a "
                                              f"rank posts in an agreement over a process group"]})


def _digest(value: Any) -> Any:
    text = _dumps(value)
    return value if len(text) <= 40 else f"<{len(text)} bytes of JSON, crc32 {zlib.crc32(text):08x}>"


def _packed(data: bytes) -> List[int]:
    words = [len(data)] + [int.from_bytes(data[i:i + 7], "little") for i in range(0, len(data), 7)]
    return words + [0] * (_WORDS - len(words))


def _unpacked(words: Sequence[int]) -> bytes:
    return b"".join(int(w).to_bytes(7, "little") for w in words[1:])[:int(words[0])]


def _recorded(t: torch.Tensor, tag: str) -> Optional[Event]:
    """An event of its own recorded after the work issued so far on the current stream (the all-reduce that fills
    ``t``: a CPU side stream completes it asynchronously); None on a graph path, outside any graph (nothing is
    read on the host inside one), where the device's stream order is enough."""
    if backends.current().is_graph:
        return None
    ev = Event(tag)
    ev.record(t)
    return ev


def _host_read(t: torch.Tensor, done: Optional[Event]) -> List[List[int]]:
    """``t.tolist()`` once ``done`` (`_recorded`) has completed."""
    if done is not None:
        done.synchronize()
    return t.tolist()


__all__ = ["Disagreement", "GroupTransport", "PendingAgreement", "Post", "StoreTransport", "Transport", "agree",
           "agree_later", "compare_posts"]
