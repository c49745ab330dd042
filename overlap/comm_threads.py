"""Real-time priority for the CPU path's communication threads, on request: a dedicated host's stand-in for a comm engine.

On a device an all-to-all runs on its own engine and never waits for the compute to give up a
core. On the CPU path gloo moves the bytes on threads of its own (``gloo_tcp_loop``,
``pt_gloo_runloop``) and the simulated link completes transfers on its clock thread. When every
core computes, a thread of theirs that wakes waits for the scheduler to take a core from the
compute: milliseconds on a small host. Measured on 2 cores, 2 ranks, a 16-float all-to-all right
after 2 ms of compute: a median 0.7-1.2 ms and a third of them over 2 ms after both ranks had
entered it; with these threads at ``SCHED_FIFO`` a median 0.35 ms and 2% over 2 ms.

So on request (``rt``), where the process may (root, ``CAP_SYS_NICE`` or an ``RLIMIT_RTPRIO`` of
at least 1), those threads run ``SCHED_FIFO`` at the lowest real-time priority. They sleep until
there is work, and the kernel's real-time throttling bounds what they can take. Compute threads
are never touched. Where it is not permitted (or not Linux) everything runs as before, and
`describe_comm_priority` says why.

It is off by default: on a host the job has to itself it made serial prefill about 1.2x faster
(`launch.bench.comm_threads`), but beside a process computing on one core serial prefill took 2x
and two-batch 3x as long as with normal threads: the raised threads take the core from this job's
own compute as well as from the other work. A setting that can make a user's job slower on a
shared host is not a default (docs/planning.md has the figures).

The switch: ``$OVERLAP_CPU_COMM_PRIORITY`` = ``off`` (the default) or ``rt``, or `set_comm_priority`
(the launcher's ``--cpu-comm-priority``). Threads are found when the CPU backend issues a
collective and a thread started or ended since the last look (one listing of ``/proc/self/task``
per collective, and a few more after a thread started, since gloo's threads name themselves a moment
later), so a process group created later gets its threads raised at its first collective. Off, nothing
is listed once a look has lowered what there was.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Set

from .state import STATE

ENV_COMM_PRIORITY = "OVERLAP_CPU_COMM_PRIORITY"
MODES = ("rt", "off")
DEFAULT_MODE = "off"  # rt loses beside another job of this kind on a shared host (module docstring)
RT_PRIORITY = 1  # the lowest SCHED_FIFO priority: above every normal thread, below the kernel's own
COMM_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")  # gloo's transport loop and process-group workers
_TASKS = "/proc/self/task"
_RECHECKS = 3  # looks after a thread started (gloo's threads are named by themselves, a moment after starting)
_LOG = logging.getLogger(__name__)


class _Registry:
    """What this process has raised, and why it stopped trying (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.enrolled: Set[int] = set()  # native ids of the toolkit's own comm threads (the link's clock)
        self.raised: Set[int] = set()  # native ids running SCHED_FIFO because of this module
        self.seen_tasks: frozenset = frozenset()  # /proc/self/task's entries at the last look
        self.recheck = 0  # looks still due with the same entries: a new thread names itself just after it starts
        self.applied: Optional[str] = None  # the mode the last look applied
        self.unavailable: Optional[str] = None  # why raising is not possible in this process

    def forget_parent(self) -> None:
        # a forked child has the parent's sets but none of its threads
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.enrolled.clear()
            self.raised.clear()
            self.seen_tasks = frozenset()
            self.applied = None


_REG = _Registry()


def _parse(mode: str, source: str) -> str:
    value = mode.strip().lower()
    if value not in MODES:
        raise ValueError(f"{source}: expected one of {', '.join(MODES)}, got {mode!r}")
    return value


def env_comm_priority() -> Optional[str]:
    """``$OVERLAP_CPU_COMM_PRIORITY`` (``rt`` or ``off``), None when unset or empty; ValueError naming it otherwise."""
    env = os.environ.get(ENV_COMM_PRIORITY, "")
    return _parse(env, f"${ENV_COMM_PRIORITY}") if env.strip() else None


def requested_mode() -> str:
    """The mode asked for: `set_comm_priority`'s, else ``$OVERLAP_CPU_COMM_PRIORITY``'s, else `DEFAULT_MODE`."""
    if STATE.comm_priority is not None:
        return STATE.comm_priority
    return env_comm_priority() or DEFAULT_MODE


def set_comm_priority(mode: Optional[str]) -> None:
    """Raise (``"rt"``) or lower (``"off"``) this process's communication threads now; None: the environment's.

    Lowering puts the communication threads back to ``SCHED_OTHER``. ``overlap.reset()`` forgets
    the setting (the next collective applies the environment's).
    """
    value = None if mode is None else _parse(mode, "set_comm_priority")
    STATE.comm_priority = value  # overlap.reset() forgets it: the environment's again
    prioritize_comm_threads()


def enrol_current_thread() -> None:
    """Count the calling thread as a communication thread (the toolkit's own, e.g. the link's clock)."""
    with _REG.lock:
        _REG.forget_parent()
        _REG.enrolled.add(threading.get_native_id())
        _REG.seen_tasks = frozenset()  # look again at the next collective


def prioritize_comm_threads() -> int:
    """Bring the communication threads to the requested mode; returns how many run real-time now.

    Cheap when no thread started or ended (one listing of ``/proc/self/task``, 10-40 us), and free when
    off (the default) once a look has found nothing raised: the CPU backend calls it before every collective.
    """
    mode = requested_mode()
    with _REG.lock:
        _REG.forget_parent()
        if _REG.unavailable is not None:
            return 0
        if mode == "off" and _REG.applied == "off" and not _REG.raised:
            return 0  # the last look lowered every comm thread and none was raised since: nothing to list
        try:
            # the entries, not their count: a group destroyed and another created keep the count
            tasks = frozenset(os.listdir(_TASKS))
        except OSError:
            _REG.unavailable = f"{_TASKS} is not readable (not Linux?)"
            return 0
        if tasks == _REG.seen_tasks and mode == _REG.applied:
            if _REG.recheck <= 0:
                return len(_REG.raised)
            _REG.recheck -= 1
        else:
            _REG.recheck = _RECHECKS
        _REG.seen_tasks, _REG.applied = tasks, mode
        live = {int(t) for t in tasks}
        _REG.raised &= live
        _REG.enrolled &= live
        comm = {tid for tid in live if tid in _REG.enrolled or _thread_name(tid) in COMM_THREAD_NAMES}
        if mode == "off":
            # a thread started by a raised one inherits its policy (the link's clock, started from a
            # completion on gloo's thread): lower every comm thread, not only those raised here
            for tid in sorted(_REG.raised | comm):
                if _policy(tid) == os.SCHED_FIFO:
                    _set_policy(tid, os.SCHED_OTHER, 0)
            _REG.raised.clear()
            return 0
        for tid in sorted(comm - _REG.raised):
            try:
                _set_policy(tid, os.SCHED_FIFO, RT_PRIORITY)
            except PermissionError:
                _REG.unavailable = ("not permitted: real-time threads need root, CAP_SYS_NICE or an "
                                    "RLIMIT_RTPRIO of at least 1")
                _LOG.info("CPU communication threads keep normal priority: %s", _REG.unavailable)
                return len(_REG.raised)
            _REG.raised.add(tid)
        return len(_REG.raised)


def comm_priority() -> str:
    """What the CPU path's communication threads run at in this process: ``"rt"``, or ``"off"`` where
    turned off or not permitted (what a measurement's validity depends on)."""
    prioritize_comm_threads()
    return "off" if requested_mode() == "off" or _REG.unavailable is not None else "rt"


def describe_comm_priority() -> str:
    """`comm_priority` in words, with the reason where real-time was asked for and is not possible."""
    raised = prioritize_comm_threads()
    if requested_mode() == "off":
        return "normal priority"
    if _REG.unavailable is not None:
        return f"normal priority ({_REG.unavailable})"
    return f"real-time (SCHED_FIFO {RT_PRIORITY}, {raised} thread{'s' if raised != 1 else ''})"


def raised_threads() -> Set[int]:
    """Native ids of the threads this module runs real-time now."""
    with _REG.lock:
        _REG.forget_parent()
        return set(_REG.raised)


def _thread_name(tid: int) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def _policy(tid: int) -> int:
    try:
        return os.sched_getscheduler(tid)
    except OSError:  # the thread ended meanwhile
        return -1


def _set_policy(tid: int, policy: int, priority: int) -> None:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(priority))
    except ProcessLookupError:  # the thread ended meanwhile
        pass
