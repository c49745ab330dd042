"""The interface every execution path implements, with the defaults most paths share.

A backend lowers the toolkit's primitives on one path: it enters a stream, records and waits
events, adds ordering edges and memory-safety calls, issues collectives and host work, limits
cores, synchronises and times. It keeps no state of its own (that is `overlap.state.STATE`).
The capability flags at the top are what code outside the backends asks instead of comparing
path names.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, List, Optional, Protocol, Sequence

import torch

from .. import hooks
from ..context import DEFAULT, current_stream_tag
from ..hooks import Span


class Ahead(Protocol):
    """Host work running ahead on a stream's own thread (`overlap.issue_ahead`)."""

    def result(self) -> Any:
        """What it returned, once it has (what it raised, raised here); `WaitTimeout` past the wait bound."""


class Backend:
    """How the primitives lower on one execution path (see the module docstring)."""

    name = ""
    device_type = "cpu"  # where this path's tensors live
    process_group_backend = "gloo"  # torch.distributed backend of this device
    is_graph = False  # inside a compiled graph: nothing is read on the host, launches are not seen one by one
    data_edges_order_streams = False  # the graph compiler orders a value's readers after its writer on any stream
    events_are_global = False  # one event per tag for the whole process (torchair's tagged events)
    has_npu_ops = False  # torch_npu's fused operators (grouped matmul, MoE routing) are available
    torchair_mode: Optional[str] = None  # torchair CompilerConfig.mode that compiles for this path

    def compile_backend(self) -> Any:
        """What to pass as ``torch.compile(backend=...)`` to compile for this path (None: an eager path)."""
        return None

    # ---- device
    def device(self) -> torch.device:
        """This path's current device."""
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Select the device of a rank (``LOCAL_RANK``) on this node."""

    # ---- streams
    def stream_scope(self, tag: str, priority: int, outer: str) -> Optional[ContextManager[Any]]:
        """What to enter so that work runs on stream ``tag`` (None: nothing); ``outer`` is the tag left."""
        return None

    def get_stream(self, tag: str, priority: int = 0) -> Any:
        """The stream object behind ``tag``."""
        raise ValueError(f"the {self.name} path has no stream objects: streams are graph labels there")

    def stream_tags(self) -> List[str]:
        """Every stream tag created so far on this path, the main stream included."""
        return [DEFAULT]

    # ---- ordering
    def record(self, event: Any) -> None:
        """Record ``event`` on the current stream (``event.guarded``: the tensors it protects)."""

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Make the current stream wait for ``event``'s last record; returns the consumers to use."""
        return consumers

    def synchronize_event(self, event: Any) -> None:
        """The host waits for ``event``'s last record."""

    def wait_tensor(self, x: torch.Tensor, deps: Sequence[torch.Tensor]) -> torch.Tensor:
        """An ordering edge ``deps -> x``. Without a per-tensor edge the current stream joins every
        other stream's work so far: correct, but coarse."""
        me = current_stream_tag()
        if hooks.active():
            for tag in [t for t in self.stream_tags() if t != me]:
                hooks.event_recorded(f"join:{tag}->{me}", tag)
                hooks.event_waited(f"join:{tag}->{me}", me)
        self.join_other_streams()
        return x

    def join_other_streams(self) -> None:
        """The current stream waits for the work issued so far on every other stream."""

    def record_stream(self, tensor: torch.Tensor, tag: str) -> None:
        """Tell the allocator that ``tensor`` is used on stream ``tag``."""

    # ---- launches
    def is_asynchronous(self, tag: str) -> bool:
        """Whether work issued on ``tag`` completes on another thread of the host (the CPU engine)."""
        return False

    def issue_collective(self, name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor],
                         writes: Sequence[torch.Tensor], span: Optional[Span], nbytes: int) -> None:
        """Issue a collective on the current stream; ``issue(async_op)`` calls torch.distributed."""
        try:
            issue(False)
        finally:
            hooks.end_span(span)

    def issue_host(self, name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor],
                   writes: Sequence[torch.Tensor], span: Optional[Span]) -> None:
        """Run host work (a copy) on the current stream."""
        try:
            fn()
        finally:
            hooks.end_span(span)

    def issue_ahead(self, name: str, fn: Callable[[], Any], tag: str) -> Optional["Ahead"]:
        """Run ``fn`` on stream ``tag``'s own thread, where the path has one (see `overlap.issue_ahead`);
        None here: the caller runs it later, in place."""
        return None

    def synchronize(self) -> None:
        """The host waits for all work on all streams of this path."""

    # ---- cores and timing
    def core_scope(self, aic: int, aiv: int) -> Optional[ContextManager[Any]]:
        """What to enter so that operators run on at most ``aic`` cube and ``aiv`` vector cores (None: nothing)."""
        return None

    def soc_version(self) -> Optional[str]:
        """The chip's name in CANN's ``platform_config`` (NPU paths only)."""
        return None

    def clock(self) -> Any:
        """A device clock for the timeline (None: host clocks are the launches' times)."""
        return None

