"""The eager device paths, ``cuda`` and ``npu``: one device stream per tag, device events, record_stream.

The main stream (tag ``DEFAULT``) is the caller's: the stream current when the toolkit first leaves it for a side
stream, not the device's default stream. A model run on a stream of its own (a serving engine's) keeps its work
there, and a graph capture (``torch.cuda.graph``, which captures on a stream of its own) sees every launch: work
sent to the device's default stream while another stream captures invalidates the capture.

Both devices have the same stream API (``torch.cuda`` / ``torch.npu``: ``Stream``, ``Event``,
``stream()``, ``current_stream()``, ``synchronize()``); the NPU adds per-stream core limits
(``torch.npu.set_stream_limit``) and torch_npu's fused operators. torch_npu is imported only
when the ``npu`` path is used.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..context import DEFAULT
from ..hooks import Span
from ..state import STATE
from .base import Backend


# the caller's stream while a side-stream scope is entered (unset outside any: the current stream is the main one)
_main_stream: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("overlap_main_stream", default=None)


class DeviceClock:
    """Device events with timing around each launch, converted to host seconds on demand."""

    def __init__(self, mod: Any):
        self.mod = mod
        mod.synchronize()
        self.ref = mod.Event(enable_timing=True)
        self.ref.record()
        mod.synchronize()
        self.ref_time = time.time()
        self.open: Dict[int, Any] = {}
        self.closed: List[Tuple[Span, Any, Any]] = []

    def start(self, span: Span) -> None:
        ev = self.mod.Event(enable_timing=True)
        ev.record()
        self.open[span.id] = ev

    def end(self, span: Span, copy: Span) -> bool:
        ev0 = self.open.pop(span.id, None)
        if ev0 is None:
            return False
        ev1 = self.mod.Event(enable_timing=True)
        ev1.record()
        self.closed.append((copy, ev0, ev1))
        return True

    def resolve(self) -> None:
        for span, ev0, ev1 in self.closed:
            ev1.synchronize()
            span.start = self.ref_time + self.ref.elapsed_time(ev0) / 1e3
            span.end = self.ref_time + self.ref.elapsed_time(ev1) / 1e3
        self.closed.clear()


class _NpuCoreLimit:
    """``torch.npu.set_stream_limit`` on the current stream; on exit the stream's previous limit returns.

    The previous limit is read from the stream itself (``get_stream_limit``): torch_npu returns a new
    Python object from every ``current_stream()`` call, so nothing can be keyed by the object.
    """

    def __init__(self, aic: int, aiv: int):
        self.limit = (aic, aiv)

    def __enter__(self) -> None:
        self.stream = torch.npu.current_stream()
        outer = torch.npu.get_stream_limit(self.stream)
        self.outer = (outer["cube_core_num"], outer["vector_core_num"])
        torch.npu.set_stream_limit(self.stream, *self.limit)

    def __exit__(self, *exc: Any) -> None:
        aic, aiv = self.outer
        if aic > 0 and aiv > 0:
            torch.npu.set_stream_limit(self.stream, aic, aiv)
            return
        # a part that was never limited: clear both, then put back the part that was (-1 leaves one as is)
        torch.npu.reset_stream_limit(self.stream)
        if aic > 0 or aiv > 0:
            torch.npu.set_stream_limit(self.stream, aic if aic > 0 else -1, aiv if aiv > 0 else -1)


class DeviceBackend(Backend):
    """``cuda`` or ``npu`` eager streams (``kind`` names the device and the path)."""

    def __init__(self, kind: str):
        self.name = self.device_type = kind
        self.process_group_backend = {"cuda": "nccl", "npu": "hccl"}[kind]
        self.has_npu_ops = kind == "npu"

    @property
    def mod(self) -> Any:
        """``torch.cuda`` or ``torch.npu``."""
        if self.device_type == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        return getattr(torch, self.device_type)

    def device(self) -> torch.device:
        return torch.device(self.device_type, self.mod.current_device())

    def set_device(self, local_rank: int) -> None:
        self.mod.set_device(local_rank % max(1, self.mod.device_count()))

    def main_stream(self) -> Any:
        """The main stream (``DEFAULT``): the caller's, current when the outermost side-stream scope was entered."""
        main = _main_stream.get()
        return self.mod.current_stream() if main is None else main

    def get_stream(self, tag: str, priority: int = 0) -> Any:
        mod = self.mod
        if tag == DEFAULT:
            return self.main_stream()
        key = (self.device_type, mod.current_device(), tag)
        with STATE.lock:
            s = STATE.device_streams.get(key)
            if s is None:
                s = STATE.device_streams[key] = mod.Stream(priority=priority)
            return s

    def stream_tags(self) -> List[str]:
        with STATE.lock:
            return sorted({DEFAULT} | {t for (kind, _, t) in STATE.device_streams if kind == self.device_type})

    def stream_scope(self, tag: str, priority: int, outer: str) -> Optional[ContextManager[Any]]:
        if tag == DEFAULT and _main_stream.get() is None:
            return None  # on the main stream already
        return self._scope(tag, priority)

    @contextlib.contextmanager
    def _scope(self, tag: str, priority: int) -> Iterator[Any]:
        token = _main_stream.set(self.main_stream())
        try:
            with self.mod.stream(self.get_stream(tag, priority)) as s:
                yield s
        finally:
            _main_stream.reset(token)

    def _event(self, event: Any) -> Any:
        ev = event.payload.get(self.name)
        if ev is None:
            ev = event.payload[self.name] = self.mod.Event()
        return ev

    def record(self, event: Any) -> None:
        self._event(event).record()

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        self.mod.current_stream().wait_event(self._event(event))
        return consumers

    def synchronize_event(self, event: Any) -> None:
        ev = event.payload.get(self.name)
        if ev is not None:
            ev.synchronize()

    def join_other_streams(self) -> None:
        mod = self.mod
        cur = mod.current_stream()
        with STATE.lock:
            mine = [s for (kind, _, _), s in STATE.device_streams.items() if kind == self.device_type]
        for s in [self.main_stream()] + mine:
            if s != cur:
                cur.wait_stream(s)

    def record_stream(self, tensor: torch.Tensor, tag: str) -> None:
        if tensor.device.type == self.device_type:
            tensor.record_stream(self.get_stream(tag))

    def synchronize(self) -> None:
        self.mod.synchronize()

    def core_scope(self, aic: int, aiv: int) -> Optional[ContextManager[Any]]:
        return _NpuCoreLimit(aic, aiv) if self.device_type == "npu" else None

    def soc_version(self) -> Optional[str]:
        if self.device_type != "npu":
            return None
        try:
            return self.mod.get_device_name()
        except Exception:
            return None

    def clock(self) -> DeviceClock:
        return DeviceClock(self.mod)

