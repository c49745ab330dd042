"""The timeline: every launch through the toolkit's primitives as a span, exported and measured.

``with Timeline() as tl:`` installs an observer on the hooks for the duration of the block (off
by default; with no observer the hooks are a no-op). A finished span carries rank, stream, kind,
name, its meta (``mb``, ``layer`` ... inherited from enclosing ``overlap.span`` blocks) and its
start and end in seconds on the host's wall clock, so that ranks can be merged.

Where the time comes from:
- ``cpu``: host clocks. An asynchronous collective or copy ends when it really completes (gloo's
  completion callback, the copy thread), not when somebody waits for it.
- ``cuda`` / ``npu``: device events with timing recorded around each launch on its stream,
  converted to host time against a reference event recorded when the timeline started.
- ``ge`` / ``aclgraph``: launches inside a compiled graph are not seen one by one; use the
  torch_npu profiler and ``overlap-report`` there.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

from .. import backends, hooks
from ..hooks import Span
from ._intervals import Metrics, compute_metrics, verdict

_STREAM_ORDER = ("default", "ep_comm", "shared_expert", "indexer", "kv_offload")
GENERATOR = "npu-overlap"


def intersects(a: Span, b: Span) -> bool:
    """True when the two finished spans ran at the same time for a non-zero while."""
    if a.end is None or b.end is None:
        raise ValueError(f"span {a.name if a.end is None else b.name!r} has not finished")
    return max(a.start, b.start) < min(a.end, b.end)


def find(spans: Sequence[Span], name: Optional[str] = None, stream: Optional[str] = None,
         kind: Optional[str] = None, rank: Optional[int] = None, **meta: Any) -> List[Span]:
    """The spans matching every given field; ``meta`` matches entries of ``Span.meta`` (e.g. ``layer=3``)."""
    return [s for s in spans
            if (name is None or s.name == name) and (stream is None or s.stream == stream)
            and (kind is None or s.kind == kind) and (rank is None or s.rank == rank)
            and all(s.meta.get(k) == v for k, v in meta.items())]


def metrics(spans: Sequence[Span]) -> Metrics:
    """Busy time per stream, overlap per pair, overlap / min(busy) and hidden share of communication, as
    `overlap.observability._intervals` defines them (the launcher's and ``overlap-report``'s figures)."""
    return compute_metrics((s.rank, s.stream, s.kind, s.start, s.end) for s in spans if s.end is not None)


def _stream_ids(spans: Sequence[Span]) -> Dict[str, int]:
    names = {s.stream for s in spans}
    ordered = [t for t in _STREAM_ORDER if t in names] + sorted(names - set(_STREAM_ORDER))
    return {t: i for i, t in enumerate(ordered)}


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def chrome_trace(spans: Sequence[Span], prediction: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A Chrome trace (JSON object format): one process per rank, one thread per stream, times in us.

    ``prediction`` marks the spans as predicted, not measured (``otherData.prediction``: what was
    predicted, such as the schedule's name); ``overlap-report --plan`` takes only such a trace as the plan.
    """
    done = sorted((s for s in spans if s.end is not None), key=lambda s: (s.rank, s.start))
    origin = min((s.start for s in done), default=0.0)
    tids = _stream_ids(done)
    events: List[Dict[str, Any]] = []
    for rank in sorted({s.rank for s in done}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tag in sorted({s.stream for s in done if s.rank == rank}, key=tids.__getitem__):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[tag], "args": {"name": tag}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tids[tag],
                           "args": {"sort_index": tids[tag]}})
    for s in done:
        args = {"stream": s.stream, "kind": s.kind, "rank": s.rank, "async": s.asynchronous}
        args.update({k: _jsonable(v) for k, v in s.meta.items()})
        events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": s.rank, "tid": tids[s.stream],
                       "ts": round((s.start - origin) * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
                       "args": args})
    other: Dict[str, Any] = {"generator": GENERATOR, "origin_epoch_s": origin}
    if prediction is not None:
        other["prediction"] = {k: _jsonable(v) for k, v in prediction.items()}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def save_chrome_trace(spans: Sequence[Span], file: str, prediction: Optional[Mapping[str, Any]] = None) -> str:
    """Write `chrome_trace` to ``file`` (opens in Perfetto, chrome://tracing, MindStudio Insight)."""
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with open(file, "w") as f:
        json.dump(chrome_trace(spans, prediction), f)
    return file


def _fmt_share(share: Optional[float]) -> str:
    return "no communication" if share is None else f"{share:.0%} of communication hidden"


def save_png(spans: Sequence[Span], file: str, title: Optional[str] = None) -> str:
    """Draw one lane per rank and stream, spans coloured by micro-batch and hatched by kind, the layer
    written on the longest span of each micro-batch and layer where it fits, the legend beside the
    plot and the hidden share of communication in the title (`overlap.observability._png`).

    Needs matplotlib (the ``plot`` extra).
    """
    from . import _png

    done = [s for s in spans if s.end is not None]
    tids = _stream_ids(done)
    lanes = sorted({(s.rank, s.stream) for s in done}, key=lambda k: (k[0], tids[k[1]]))
    m = metrics(done)
    heading = _png.title_of(title, m.hidden_share, {r: rm.hidden_share for r, rm in m.per_rank.items()})
    return _png.draw(done, file, lanes, heading)


def gather(spans: Sequence[Span], group: Any = None) -> List[Span]:
    """All ranks' spans on every rank (a collective: call it on every rank of ``group``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(spans)
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, [dataclasses.replace(s, reads=(), writes=()) for s in spans], group=group)
    return sorted((s for part in out for s in part), key=lambda s: (s.rank, s.start))


def summary(spans: Sequence[Span]) -> str:
    """Per-rank busy time, pairwise overlap with verdicts and the hidden share, as text."""
    m = metrics(spans)
    lines = []
    for rank, rm in sorted(m.per_rank.items()):
        busy = ", ".join(f"{t} {b * 1e3:.3f} ms" for t, b in sorted(rm.busy.items()))
        lines.append(f"rank {rank}: busy {busy}; {_fmt_share(rm.hidden_share)}")
        for (a, b), ov in sorted(rm.overlap.items()):
            r = rm.ratio(a, b)
            lines.append(f"  {a} | {b}: overlap {ov * 1e3:.3f} ms, overlap/min(busy) {r:.2f} ({verdict(r)})")
    return "\n".join(lines)



def _detached(span: Span, offset: float) -> Span:
    """A copy of ``span`` that holds no tensors, its times shifted by ``offset`` (``dataclasses.replace``,
    without its cost: this runs for every observed launch)."""
    copy = Span.__new__(Span)
    copy.__dict__.update(span.__dict__)
    copy.reads, copy.writes, copy.meta = (), (), dict(span.meta)
    copy.start, copy.end = span.start + offset, (span.end or span.start) + offset
    return copy

class Timeline:
    """Records a span for every launch while active: ``with Timeline() as tl: ...; tl.spans``."""

    def __init__(self, device_timing: bool = True):
        self.device_timing = device_timing
        self._spans: List[Span] = []
        self._lock = threading.Lock()
        self._offset = 0.0  # wall clock minus the hooks' perf_counter
        self._device: Any = None  # the backend's device clock (cuda / npu), or None
        self._open: Set[int] = set()  # spans started while active and not finished yet
        self.active = False

    def start(self) -> "Timeline":
        self._device = backends.current().clock() if self.device_timing else None
        self._offset = time.time() - time.perf_counter()
        with self._lock:
            self.active = True
        hooks.add_observer(self)
        return self

    def stop(self) -> "Timeline":
        """Stop recording; asynchronous launches still in flight are recorded when they complete."""
        with self._lock:
            self.active = False
            if not self._open:
                hooks.remove_observer(self)
        return self

    def __enter__(self) -> "Timeline":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # hooks observer
    def on_span_start(self, span: Span) -> None:
        with self._lock:
            if not self.active:
                return
            self._open.add(span.id)
            if self._device is not None and not span.asynchronous:
                self._device.start(span)

    def on_span_end(self, span: Span) -> None:
        copy = _detached(span, self._offset)
        with self._lock:
            if span.id not in self._open:
                return
            self._open.discard(span.id)
            if self._device is not None:
                self._device.end(span, copy)
            self._spans.append(copy)
            if not self.active and not self._open:
                hooks.remove_observer(self)

    @property
    def spans(self) -> List[Span]:
        """The finished spans of this rank, by start time (device spans resolved on first access)."""
        with self._lock:
            if self._device is not None:
                self._device.resolve()
            return sorted(self._spans, key=lambda s: s.start)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def find(self, name: Optional[str] = None, stream: Optional[str] = None, kind: Optional[str] = None,
             **meta: Any) -> List[Span]:
        """See `find`."""
        return find(self.spans, name, stream, kind, **meta)

    def gather(self, group: Any = None) -> List[Span]:
        """See `gather` (collective)."""
        return gather(self.spans, group)

    def metrics(self, spans: Optional[Sequence[Span]] = None) -> Metrics:
        """See `metrics`; of this rank's spans unless ``spans`` (e.g. gathered) are given."""
        return metrics(self.spans if spans is None else spans)

    def summary(self, spans: Optional[Sequence[Span]] = None) -> str:
        return summary(self.spans if spans is None else spans)

    def save_chrome_trace(self, file: str, spans: Optional[Sequence[Span]] = None) -> str:
        """Write this rank's spans (or ``spans``, e.g. from `gather`) as a Chrome trace."""
        return save_chrome_trace(self.spans if spans is None else spans, file)

    def save_png(self, file: str, spans: Optional[Sequence[Span]] = None, title: Optional[str] = None) -> str:
        """Draw this rank's spans (or ``spans``) as a PNG; needs matplotlib."""
        return save_png(self.spans if spans is None else spans, file, title)
