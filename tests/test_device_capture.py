"""The decode step captured on a device stream, checked on CPU against a model of CUDA's capture rules.

``torch.cuda.graph`` captures on a stream of its own. Work launched while it captures must go to that stream or to a
stream that has waited on an event recorded in the capture (it joins the capture); work on any other stream, the
device's default stream above all, invalidates it ("operation not permitted when stream is capturing"), and so
does the host waiting on the device. `_FakeDevice` stands in for ``torch.cuda`` with those rules (streams, events,
``stream()``, ``graph()``), so every decode mode's captured step (`launch.engine.graph_decoder`) runs here on the
``cuda`` path over CPU tensors, and each launch is checked against them. On a GPU, `.ci/device-smoke` runs the real
capture.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional

import pytest

import overlap
from overlap.backends.device import DeviceBackend
from overlap.multirank import run_ranks

pytestmark = pytest.mark.spawns_ranks


class _Stream:
    def __init__(self, dev: "_FakeDevice", name: str):
        self.dev, self.name, self.capturing = dev, name, False

    def wait_event(self, event: "_Event") -> None:
        self.capturing = self.capturing or event.captured  # waiting on an event of the capture joins it
        self.dev.launch(self, "wait_event")

    def wait_stream(self, other: "_Stream") -> None:
        event = _Event(self.dev)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.dev.host_wait("Stream.synchronize")


class _Event:
    def __init__(self, dev: "_FakeDevice", enable_timing: bool = False, **_: object):
        self.dev, self.captured = dev, False

    def record(self, stream: Optional[_Stream] = None) -> None:
        stream = stream or self.dev.current
        self.dev.launch(stream, "Event.record")
        self.captured = stream.capturing

    def synchronize(self) -> None:
        self.dev.host_wait("Event.synchronize")

    def query(self) -> bool:
        self.dev.host_wait("Event.query")
        return True

    def elapsed_time(self, other: "_Event") -> float:
        return 0.0


class _Graph:
    def replay(self) -> None:
        pass


class _FakeDevice:
    """``torch.cuda`` as far as the toolkit's device path and `launch.engine.graph_decoder` use it, with capture rules:
    ``problems`` lists each launch on a stream outside a running capture and each host wait inside one."""

    CUDAGraph = _Graph

    def __init__(self):
        self.default = _Stream(self, "the device's default stream")
        self.current = self.default
        self.capturing = False
        self.problems: List[str] = []
        self.streams = 0

    def launch(self, stream: _Stream, what: str) -> None:
        if self.capturing and not stream.capturing:
            self.problems.append(f"{what} on {stream.name}, outside the capture")

    def host_wait(self, what: str) -> None:
        if self.capturing:
            self.problems.append(f"{what}: the host waits during the capture")

    def Stream(self, priority: int = 0) -> _Stream:  # noqa: N802  (torch.cuda's name)
        self.streams += 1
        return _Stream(self, f"side stream {self.streams}")

    def Event(self, enable_timing: bool = False, **kw: object) -> _Event:  # noqa: N802
        return _Event(self, enable_timing)

    def current_stream(self) -> _Stream:
        return self.current

    def default_stream(self) -> _Stream:
        return self.default

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        outer, self.current = self.current, s
        try:
            yield
        finally:
            self.launch(s, "work")  # what ran inside went to s
            self.current = outer

    @contextlib.contextmanager
    def graph(self, g: _Graph, capture_error_mode: str = "global"):
        self.streams += 1
        capture = _Stream(self, "the capture stream")
        capture.capturing = self.capturing = True
        outer, self.current = self.current, capture
        try:
            yield
        finally:
            self.capturing = False
            self.current = outer

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        self.host_wait("synchronize")


@dataclasses.dataclass
class _Captured:
    mode: str
    buckets: List[int]
    problems: List[str]


def _capture_body(ctx, modes):
    import dataclasses as dc

    from launch.engine import generate, new_cache
    from launch.engine import GraphDecoder
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    cfg = dc.replace(preset("tiny"), n_experts=12)
    prompts, limits = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1, 4, 1, 5]], [3, 2, 4, 3]
    out = []
    dev = _FakeDevice()
    DeviceBackend.mod = property(lambda self: dev)  # this rank's process only
    with overlap.use_path("cuda"):
        model = make_expert_parallel(build_model(cfg, seed=3), ctx.group)
        for mode in modes:
            decoder = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cuda")
            generate(model, prompts, limits, decoder=decoder)  # captures each bucket it meets (replays do nothing)
            out.append(_Captured(mode, decoder.compiled_buckets, list(dev.problems)))
            dev.problems.clear()
    return out


def test_every_decode_mode_captures_on_the_callers_stream():
    """Every mode's captured step launches only on the capture stream and streams that joined it: the main stream
    is the caller's (the capture's), never the device's default stream, and no host wait falls in a capture."""
    modes = ("serial", "shared", "two-batch", "chunked-2", "chunked-3")
    for got in run_ranks(_capture_body, 1, modes, timeout=120)[0]:
        assert got.buckets, got  # something was captured
        assert not got.problems, (got.mode, got.problems[:5])
