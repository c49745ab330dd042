"""An exchange issued on a side stream: entered after the caller's work (`on_side`), and the events that order
its readers after it (`exchange_event`, each call's own `call_event`)."""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Optional

import torch

import overlap
from overlap import backends


@contextlib.contextmanager
def on_side(stream_tag: Optional[str], previous_event: Optional[overlap.Event], event_tag: str) -> Iterator[str]:
    """Enter ``stream_tag`` after the calling stream's work so far and after ``previous_event``; yields the
    calling stream's tag.

    The calling stream's work includes what the exchange just prepared there (its packed send buffers), so
    the side stream always waits for it; ``previous_event`` adds an edge to work on a third stream. With
    ``stream_tag`` None (or the caller's) the exchange stays on the calling stream.
    """
    caller = overlap.current_stream_tag()
    if stream_tag is None or stream_tag == caller:
        if previous_event is not None:
            previous_event.wait()
        yield caller
        return
    ready = call_event(f"{event_tag}.ready")
    ready.record()
    with overlap.stream(stream_tag):
        if previous_event is not None:
            previous_event.wait()
        ready.wait()
        yield caller


_call_ids = itertools.count()


def call_event(tag: str) -> overlap.Event:
    """An event for one call: its own object on eager paths, so that two exchanges in flight are
    waited for separately; the one tagged event per tag on graph paths, where tags are global."""
    if backends.current().events_are_global:
        return overlap.event(tag)
    return overlap.Event(f"{tag}#{next(_call_ids)}")


def exchange_event(stream_tag: Optional[str], caller: str, event_tag: str,
                   *guarded: torch.Tensor) -> Optional[overlap.Event]:
    """An event recorded after the exchange where it runs on a side stream (`on_side`); None on the caller's."""
    if stream_tag is None or stream_tag == caller:
        return None
    ev = call_event(event_tag)
    ev.record(*guarded)
    return ev


__all__ = ["call_event", "exchange_event", "on_side"]
