"""The toolkit's process-wide state, in one object, and the one call that resets it.

Streams and events are created once per tag and reused (torchair's tagged events are unique per
process, and so are a device's streams), core limits persist per stream, and the simulated link
books its transfers in order: all of that lives in `STATE`. `reset` forgets it, as a test does
between cases. Packages built on the toolkit keep their process-wide state here too
(``pools``: the dispatch's reused buffers).

Not reset: observers (a `Timeline` or `Sanitizer` is scoped by its own ``with`` block, the one
enabled from ``$OVERLAP_SANITIZE`` lives as long as the process), and torchair's tagged events,
which torchair itself cannot forget.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple

from .context import DEFAULT, set_enabled, set_path, swap_stream_tag


class ProcessState:
    """Registries and settings shared by every thread of the process (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.observers: List[Any] = []  # see overlap.hooks
        self.tagged_events: Dict[str, Any] = {}  # torchair's tagged event per tag (aclgraph)
        self.sanitizer: Any = None  # the one enabled from $OVERLAP_SANITIZE
        self.subgroups: Dict[int, Any] = {}  # multirank under torchrun: tied to the process group, never reset
        self._clear()

    def _clear(self) -> None:
        self.events: Dict[str, Any] = {}  # overlap.Event per tag
        self.cpu_streams: Dict[str, Any] = {}  # CpuStream per tag
        self.device_streams: Dict[Tuple[str, int, str], Any] = {}  # (device type, index, tag) -> stream
        self.core_budget: Any = None  # set_core_budget override
        self.core_limits: Dict[str, Tuple[int, int]] = {}  # tag -> (aic, aiv), for the budget check
        self.npu_core_limits: Dict[int, Tuple[int, int]] = {}  # innermost limit_cores per npu stream
        self.link: Any = None  # set_link override
        self.link_busy_until = 0.0  # monotonic time the simulated link is booked until
        self.pools: Dict[str, List[Any]] = {}  # reusable buffers other packages keep, by name

    def reset(self) -> None:
        with self.lock:
            self._clear()


STATE = ProcessState()


def reset() -> None:
    """Forget streams, events, core limits and budget, the link, and this context's path, switch and stream.

    Work still in flight on a CPU stream completes on its own; nothing here waits for it.
    """
    STATE.reset()
    set_path(None)
    set_enabled(None)
    swap_stream_tag(DEFAULT)

