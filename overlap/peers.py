"""Signs of life between ranks, so that a rank whose wait ran out names the rank it waited for.

Each rank of a job with a rendezvous store (torchrun's, or the store behind any `torch.distributed` default group)
posts its host and pid, then, from a daemon thread, a sign of life every ``interval`` seconds carrying two counts:
the signs it has given and the steps it has made (`peer_step`: a decode step). A rank stopped (SIGSTOP) or hung
while holding the interpreter gives no more signs; a rank waiting in a collective goes on giving them; a rank that
is alive but slow (inside a long step) gives signs and makes no steps.

When a wait runs out, `late_peers` reads every rank's signs twice, `STALE` intervals apart: a count that did not
move is a silent rank, whatever the hosts' clocks say. `diagnosis` turns what it read into words: a process of this
host that is gone or stopped (read from ``/proc``), a silent rank, a rank behind the others in steps.

`watch_peers` starts the watch once per process (`launch.engine.generate` does, on more than one rank; the
launchers do at start); `set_peer_watch(False)` keeps it from starting.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist

WATCH_INTERVAL = 0.5  # seconds between a rank's signs of life in the store
STALE = 3  # a rank that gave no sign over this many intervals is silent
_KEY = f"overlap/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restarted job reads no old keys


@dataclasses.dataclass(frozen=True)
class PeerView:
    """What the store (and, on this host, ``/proc``) says of one rank when another rank's wait ran out."""

    alive: Optional[bool] = None  # whether its signs of life went on while this rank looked; None: none heard
    steps: Optional[int] = None  # the steps it has made, as its last sign of life carried them
    last: str = "start"  # its last progress, in words (the launchers' beats)
    beat_at: Optional[float] = None  # when it said so (`time.time()` of its host)
    process: Optional[str] = None  # "stopped" or "gone" (read from /proc on this host); None: running or unknown


def diagnosis(me: int, views: Dict[int, PeerView], failed: Optional[Dict[int, str]] = None) -> str:
    """Which ranks other than ``me`` failed, stopped or fell behind, in words: ``failed`` (rank -> its one line, as
    the launchers post it), ``views`` (rank -> `PeerView`); "peers are alive; ..." when none.

    A rank's own error comes first; then the ranks that are late; a rank that failed only waiting for another (a
    timeout, a closed connection) is named last, where nobody is late."""
    failed = {r: msg for r, msg in (failed or {}).items() if r != me}
    waited = {r: msg for r, msg in failed.items() if reads_as_peer_failure(msg)}
    own = {r: msg for r, msg in failed.items() if r not in waited}
    if own:
        return _failures(own)
    if any(v.alive is not None for v in views.values()):
        most = max((v.steps for v in views.values() if v.steps is not None), default=None)
        late = [line for r in sorted(views) if r != me and r not in waited
                for line in [_late(r, views[r], most, views)] if line]
        if late:
            return ", ".join(late)
    elif not waited:
        return _oldest_beat(me, views)
    return _failures(waited) if waited else "peers are alive; the collective itself timed out"


def reads_as_peer_failure(text: str) -> bool:
    """Whether an error's text is a wait that ran out or a connection that closed (another rank's doing)."""
    return any(w in text.lower() for w in ("timed out", "timeout", "connection closed", "connection reset", "gloo",
                                           "nccl", "hccl"))


def _failures(failed: Dict[int, str]) -> str:
    return "; ".join(f"rank {r} failed: {failed[r]}" for r in sorted(failed))


def _late(r: int, view: PeerView, most: Optional[int], views: Dict[int, PeerView]) -> Optional[str]:
    """Why rank ``r`` is late, in words; None when it is not."""
    said = [f"last seen at {view.last}"] if view.beat_at is not None or view.last != "start" else []
    seen = ", ".join(said + ([f"{view.steps} steps made"] if view.steps else [])) or "no step made"
    if view.process == "gone":
        return f"rank {r} has exited ({seen})"
    if view.process == "stopped":
        return f"rank {r} is stopped (SIGSTOP or a debugger; {seen})"
    if not view.alive:
        return f"rank {r} stopped responding (no sign of life; {seen})"
    if most is not None and view.steps is not None and view.steps < most:
        ahead = min(q for q, v in views.items() if v.steps == most)
        return (f"rank {r} stopped responding (alive, but behind: {view.steps} steps made, rank {ahead} has made "
                f"{most}" + "".join(f"; {w}" for w in said) + ")")
    return None


def _oldest_beat(me: int, views: Dict[int, PeerView]) -> str:
    """Without signs of life (no watch ran): the ranks whose progress is the oldest."""
    beats = {r: v.beat_at for r, v in views.items() if v.beat_at is not None}
    if not beats:
        return "no rank reported progress"
    oldest = min(beats.values())
    stale = [r for r in sorted(views) if r != me and (r not in beats or beats[r] <= oldest + 1e-3)]
    return ", ".join(f"rank {r} stopped responding (last seen at {views[r].last})" for r in stale) \
        or "peers are alive; the collective itself timed out"


def process_state(host: str, pid: int) -> Optional[str]:
    """A process of this host: "stopped" (state T), "gone" (exited, or a zombie); None when it runs or is elsewhere."""
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None
    return "stopped" if state in "Tt" else "gone" if state in "ZXx" else None


_Signs = Dict[int, Tuple[Optional[int], Optional[int]]]  # rank -> (signs given, steps made), None where none posted


class PeerWatch:
    """This rank's signs of life in ``store``, and what it reads of the other ranks' (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world: int, interval: float = WATCH_INTERVAL):
        self.store, self.rank, self.world, self.interval = store, rank, world, interval
        self.group_store: Optional[dist.Store] = None  # the group's store this watch's client was made from
        self.steps = 0  # steps made (`step`); the watch's thread carries the count to the store
        self._signs = 0
        self._stopped = threading.Event()

    def start(self) -> None:
        """Post this rank's host and pid, then a sign of life every ``interval`` s from a daemon thread, until the
        store is gone."""
        self.store.set(f"{_KEY}/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        threading.Thread(target=self._give_signs, name="overlap-peers-watch", daemon=True).start()

    def step(self) -> None:
        """One more step made (cheap: an integer; the watch's thread carries it)."""
        self.steps += 1

    def stop(self) -> None:
        """No more signs of life (its group is gone)."""
        self._stopped.set()

    def _give_signs(self) -> None:
        while not self._stopped.is_set():
            self._signs += 1
            try:
                self.store.set(f"{_KEY}/alive/{self.rank}", f"{self._signs} {self.steps}")
            except Exception:  # the store is gone: so is the job
                return
            self._stopped.wait(self.interval)

    def views(self) -> Dict[int, PeerView]:
        """Every rank's `PeerView` (this rank's included), its signs read twice `STALE` intervals apart; at once
        where a process of this host is seen gone or stopped (the launcher may stop this rank any moment then)."""
        before = self._read_signs()
        process = {r: self._process(r) if r != self.rank else None for r in range(self.world)}
        seen = any(p is not None for p in process.values())
        if not seen:
            time.sleep(STALE * self.interval)
        after = before if seen else self._read_signs()
        views = {}
        for r in range(self.world):
            (was, _), (now, steps) = before[r], after[r]
            alive = None if now is None else (process[r] is None) if seen else was != now
            views[r] = PeerView(alive=alive, steps=steps, process=process[r])
        return views

    def _read_signs(self) -> _Signs:
        signs: _Signs = {}
        for r in range(self.world):
            key = f"{_KEY}/alive/{r}"
            if self.store.check([key]):
                given, steps = self.store.get(key).decode().split()
                signs[r] = (int(given), int(steps))
            else:
                signs[r] = (None, None)
        return signs

    def _process(self, r: int) -> Optional[str]:
        key = f"{_KEY}/pid/{r}"
        if not self.store.check([key]):
            return None
        host, pid = self.store.get(key).decode().rsplit(" ", 1)
        return process_state(host, int(pid))


_WATCH: Dict[str, object] = {"watch": None, "enabled": True}
_LOCK = threading.Lock()


def set_peer_watch(enabled: bool) -> None:
    """Whether `watch_peers` may start the watch (on by default); turned off, a running watch stops (its rank gives
    no more signs, and its waits name nobody)."""
    with _LOCK:
        _WATCH["enabled"] = bool(enabled)
        if not enabled and _WATCH["watch"] is not None:
            _WATCH["watch"].stop()  # type: ignore[attr-defined]
            _WATCH["watch"] = None


def watch_peers(interval: float = WATCH_INTERVAL) -> Optional[PeerWatch]:
    """The process's `PeerWatch` over the default group's store, started at the first call; None with one rank,
    without a store, or when turned off (`set_peer_watch`)."""
    with _LOCK:
        if not (_WATCH["enabled"] and dist.is_initialized() and dist.get_world_size() > 1):
            return _WATCH["watch"]  # type: ignore[return-value]
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):  # a group made without a store
            return None
        kept = _WATCH["watch"]
        if kept is None or kept.group_store is not store:  # type: ignore[attr-defined]  # first, or a new group
            if kept is not None:
                kept.stop()  # type: ignore[attr-defined]
            watch = PeerWatch(_own_client(store), dist.get_rank(), dist.get_world_size(), interval)
            watch.group_store = store
            watch.start()
            _WATCH["watch"] = watch
        return _WATCH["watch"]  # type: ignore[return-value]


def _own_client(store: dist.Store) -> dist.Store:
    """A client of ``store`` of the watch's own (a TCPStore client serves one call at a time: a rank blocked in a long
    store wait would hold the watch's signs back and look silent); the store itself where it cannot be cloned."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 (a store without clone: shared)
        return store


def peer_step() -> None:
    """One more step of this rank, for its peers' watch (nothing without a watch)."""
    watch = _WATCH["watch"]
    if watch is not None:
        watch.step()  # type: ignore[attr-defined]


def late_peers() -> Optional[str]:
    """Which ranks are late, in words (`diagnosis`), read now (it takes `STALE` intervals); None without a watch,
    where no rank is late, or where the store cannot be read (the caller says what it waited for)."""
    watch = _WATCH["watch"]
    if watch is None:
        return None
    try:
        said = diagnosis(watch.rank, watch.views())  # type: ignore[attr-defined]
    except Exception:  # the store is gone too
        return None
    return said if said.startswith("rank ") else None


__all__ = ["PeerView", "PeerWatch", "STALE", "WATCH_INTERVAL", "diagnosis", "late_peers", "peer_step",
           "process_state", "reads_as_peer_failure", "set_peer_watch", "watch_peers"]
