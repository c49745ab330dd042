"""The toolkit's process-wide state, in one object, and the one call that resets it.

Streams and events are created once per tag and reused (npugraph_ex's tagged events are unique per
process, and so are a device's streams), core limits persist per stream, and the simulated link
books its transfers in order: all of that lives in `STATE`, with the bound on every wait of the
CPU path (`set_wait_timeout`; a wait that runs past it raises `WaitTimeout`). `reset` forgets it
all, as a test does between cases. Packages built on the toolkit keep their process-wide state
here too (``pools``: the dispatch's reused buffers), or keep their own and are told of every reset
(`on_reset`: `microbatch`'s kept programs, which hold events that a reset forgets).

Not reset: observers (a `Timeline` or `Sanitizer` is scoped by its own ``with`` block, the one
enabled from ``$OVERLAP_SANITIZE`` lives as long as the process), the callbacks of `on_reset`, and
npugraph_ex's tagged events, which npugraph_ex itself cannot forget.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from .context import DEFAULT, set_enabled, set_path, swap_stream_tag

DEFAULT_WAIT_TIMEOUT = 300.0  # seconds
MAX_WAIT_TIMEOUT = threading.TIMEOUT_MAX  # threading's waits overflow past it (about 292 years)


class WaitTimeout(RuntimeError):
    """A wait ran past the wait bound (`set_wait_timeout`); the message names what it waited for."""


class ProcessState:
    """Registries and settings shared by every thread of the process (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.observers: List[Any] = []  # see overlap.hooks
        self.tagged_events: Dict[str, Any] = {}  # npugraph_ex's tagged event per tag (aclgraph)
        self.sanitizer: Any = None  # the one enabled from $OVERLAP_SANITIZE
        self.reset_callbacks: List[Callable[[], None]] = []  # see on_reset
        self._clear()

    def _clear(self) -> None:
        self.events: Dict[str, Any] = {}  # overlap.Event per tag
        self.cpu_streams: Dict[str, Any] = {}  # CpuStream per tag
        self.device_streams: Dict[Tuple[str, int, str], Any] = {}  # (device type, index, tag) -> stream
        self.core_budget: Any = None  # set_core_budget override
        self.core_limits: Dict[str, Tuple[int, int]] = {}  # tag -> (aic, aiv), for the budget check
        self.link: Any = None  # set_link override
        self.comm_priority: Optional[str] = None  # set_comm_priority override (overlap.comm_threads)
        self.link_busy_until = 0.0  # perf_counter time the simulated link is booked until
        self.pools: Dict[str, List[Any]] = {}  # reusable buffers other packages keep, by name
        self.wait_timeout = DEFAULT_WAIT_TIMEOUT  # seconds any one wait may block (set_wait_timeout)

    def reset(self) -> None:
        with self.lock:
            self._clear()


STATE = ProcessState()


def set_wait_timeout(seconds: Optional[float]) -> None:
    """Bound every wait of the CPU path to ``seconds`` (None: the default, 300 s).

    A wait that runs past it raises `WaitTimeout` instead of hanging the job; a simulated link
    transfer longer than it is refused when issued.
    """
    if seconds is None:
        STATE.wait_timeout = DEFAULT_WAIT_TIMEOUT
        return
    value = float(seconds)
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_TIMEOUT):
        raise ValueError(f"the wait bound must be a finite number of seconds > 0 (at most "
                         f"{MAX_WAIT_TIMEOUT:.3g}), got {seconds!r}")
    STATE.wait_timeout = value


def wait_timeout() -> float:
    """The wait bound in seconds (see `set_wait_timeout`)."""
    return STATE.wait_timeout


def raise_hint() -> str:
    """How to raise the wait bound, for the messages of `WaitTimeout`."""
    return "raise the bound with overlap.set_wait_timeout(seconds) (the launcher's --timeout)"


def on_reset(callback: Callable[[], None]) -> None:
    """Call ``callback()`` at every later `reset`, after the toolkit's own state is forgotten: how a package built
    on the toolkit drops what it keeps of its own that holds the toolkit's objects (events, streams). A callback
    registered again is still called once."""
    with STATE.lock:
        if callback not in STATE.reset_callbacks:
            STATE.reset_callbacks = STATE.reset_callbacks + [callback]  # copy on write: reset iterates without the lock


def reset() -> None:
    """Forget streams, events, core limits and budget, the link, the comm threads' priority setting,
    the wait bound, and this context's path, switch and stream; then tell the packages built on the
    toolkit (`on_reset`).

    Work still in flight on a CPU stream completes on its own; nothing here waits for it.
    """
    STATE.reset()
    set_path(None)
    set_enabled(None)
    swap_stream_tag(DEFAULT)
    for callback in STATE.reset_callbacks:
        callback()

