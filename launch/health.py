"""Rank health in a multi-rank job: heartbeats, naming the rank that died or hung, fault injection.

Each rank writes its progress into the job's rendezvous store (`Peers.beat`). A rank whose
collective fails or times out reads the others' beats and failures to say which rank is to
blame (`Peers.diagnose`), so a dead or hung peer becomes one clear line instead of a gloo /
HCCL trace. The first rank to hit an unexpected error prints its traceback (`Peers.first_to_report`).
``$OVERLAP_FAULT`` injects a fault for the tests that check all this.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from microbatch.model import MoEModel
from overlap.ranks import default_device, default_pg_backend

ENV_FAULT = "OVERLAP_FAULT"
BEFORE_JOINING = -1  # Fault.at: before the rank joins the process group


class StartError(RuntimeError):
    """Not every rank joined the job's process group in time."""


def _agent_store(timeout: float) -> Optional[dist.TCPStore]:
    """A client of torchrun's own store (there before any rank joins the group), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except Exception:  # no agent store to talk to: the plain message will do
        return None


def join_group(timeout: float) -> torch.device:
    """Join torchrun's process group (or make a group of one) on this rank's device, which it returns.

    Under torchrun each rank first marks itself started in torchrun's own store, so a rank that
    never arrives is named when the others give up after ``timeout`` seconds (`StartError`).
    """
    device = default_device()  # LOCAL_RANK picks the card on NPU / CUDA
    td = datetime.timedelta(seconds=timeout)
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(default_pg_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        return device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _agent_store(timeout)
    if store is not None:
        store.set(f"overlap/started/{rank}", "1")
    try:
        dist.init_process_group(default_pg_backend(), timeout=td)
    except Exception as exc:
        missing = [r for r in range(world) if not store.check([f"overlap/started/{r}"])] if store else []
        who = (f": rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never started" if missing
               else f" ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        raise StartError(f"not every rank joined the job within --timeout {timeout:g} s{who}") from None
    return device


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (timeout, closed connection), not this rank's bug."""
    return isinstance(exc, dist.DistError) or _reads_as_peer_failure(str(exc))


def _reads_as_peer_failure(text: str) -> bool:
    """Whether an error's text is a wait that ran out or a connection that closed (another rank's doing)."""
    return any(w in text.lower() for w in ("timed out", "timeout", "connection closed", "connection reset", "gloo",
                                           "nccl", "hccl"))


WATCH_INTERVAL = 0.5  # seconds between a rank's signs of life in the store (`Peers.watch`)
STALE = 3  # a rank silent for this many intervals has stopped responding


@dataclasses.dataclass(frozen=True)
class PeerView:
    """What the store (and, on this host, ``/proc``) says of one rank when another rank's collective failed."""

    alive_at: Optional[float] = None  # its watch's last sign of life (`time.time()`); None: no watch heard
    steps: Optional[int] = None  # the steps it has made (decode steps and beats), as its watch last carried them
    last: str = "start"  # its last progress, in words (`Peers.beat`)
    beat_at: Optional[float] = None  # when it said so
    process: Optional[str] = None  # "stopped" or "gone" (read from /proc on this host); None: running or unknown


def diagnosis(me: int, views: Dict[int, PeerView], failed: Dict[int, str], now: float,
              interval: float = WATCH_INTERVAL) -> str:
    """Which ranks other than ``me`` failed, stopped or fell behind, in words, from what the store holds: ``failed``
    (rank -> its one line), ``views`` (rank -> `PeerView`), read at ``now``; "peers are alive; ..." when none.

    A rank's own error comes first; then the ranks that are late; a rank that failed only waiting for another (a
    timeout, a closed connection) is named last, where nobody is late."""
    failed = {r: msg for r, msg in failed.items() if r != me}
    waited = {r: msg for r, msg in failed.items() if _reads_as_peer_failure(msg)}
    own = {r: msg for r, msg in failed.items() if r not in waited}
    if own:
        return _failures(own)
    if any(v.alive_at is not None for v in views.values()):
        most = max((v.steps for v in views.values() if v.steps is not None), default=None)
        late = [line for r in sorted(views) if r != me and r not in waited
                for line in [_late(r, views[r], now, interval, most, views)] if line]
        if late:
            return ", ".join(late)
    elif not waited:
        return _oldest_beat(me, views)
    return _failures(waited) if waited else "peers are alive; the collective itself timed out"


def _failures(failed: Dict[int, str]) -> str:
    return "; ".join(f"rank {r} failed: {failed[r]}" for r in sorted(failed))


def _late(r: int, view: PeerView, now: float, interval: float, most: Optional[int],
          views: Dict[int, PeerView]) -> Optional[str]:
    """Why rank ``r`` is late, in words; None when it is not."""
    seen = f"last seen at {view.last}" + (f", {view.steps} steps made" if view.steps else "")
    if view.process == "gone":
        return f"rank {r} has exited ({seen})"
    if view.process == "stopped":
        return f"rank {r} is stopped (SIGSTOP or a debugger; {seen})"
    if view.alive_at is None:
        return f"rank {r} stopped responding (no sign of life; {seen})"
    if now - view.alive_at > STALE * interval:
        return f"rank {r} stopped responding (no sign of life for {now - view.alive_at:.1f} s; {seen})"
    if most is not None and view.steps is not None and view.steps < most:
        ahead = min(q for q, v in views.items() if v.steps == most)
        return (f"rank {r} stopped responding (alive, but behind: {view.steps} steps made, rank {ahead} has made "
                f"{most}; last seen at {view.last})")
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


class Peers:
    """Heartbeats in the store, so that a rank stuck in a collective can name the rank that is gone.

    Each rank posts its host and pid, its progress in words (`beat`), and from `watch` on, a sign of life every
    `WATCH_INTERVAL` seconds carrying its steps (`step`: each decode step, each beat): a rank stopped (SIGSTOP) or
    hung holding the interpreter stops writing, a rank waiting in a collective goes on."""

    def __init__(self) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.steps = 0  # decode steps made (`step`); the watch carries it to the store
        self.interval = WATCH_INTERVAL
        self._watching = threading.Event()
        self.agent = (f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                      if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else None)

    def beat(self, what: str) -> None:
        """This rank's progress, in words (said of it when it is late), and one more step (`step`)."""
        self.step()
        self.store.set(f"overlap/progress/{self.rank}", f"{what}@{time.time():.3f}")

    def step(self) -> None:
        """One more step made (a decode step; cheap: the watch carries the count to the store)."""
        self.steps += 1

    def watch(self, interval: float = WATCH_INTERVAL) -> None:
        """Post this rank's host and pid, then a sign of life every ``interval`` s from a daemon thread, until the
        store is gone."""
        self.interval = interval
        self.store.set(f"overlap/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._watching.set()
        threading.Thread(target=self._signs_of_life, name="overlap-peers-watch", daemon=True).start()

    def _signs_of_life(self) -> None:
        while True:
            try:
                self.store.set(f"overlap/alive/{self.rank}", f"{time.time():.3f} {self.steps}")
            except Exception:  # the store is gone: so is the job
                return
            time.sleep(self.interval)

    def failed(self, msg: str) -> None:
        try:
            self.store.set(f"overlap/failed/{self.rank}", msg[:500])
        except Exception:
            pass

    def first_to_report(self, what: str = "traceback") -> bool:
        """True on the first rank to ask about ``what`` (the one that prints it); True if the store is gone."""
        try:
            return self.store.add(f"overlap/report/{what}", 1) == 1
        except Exception:
            return True

    def diagnose(self) -> str:
        """Which ranks failed, stopped or fell behind, in words (`diagnosis`). Where every peer looks alive, the
        store is read again for up to 2 intervals: a rank killed a moment ago has not yet gone silent."""
        try:
            said = self._diagnosis()
            deadline = time.monotonic() + 2 * self.interval + 0.1
            while said.startswith("peers are alive") and self._watching.is_set() and time.monotonic() < deadline:
                time.sleep(self.interval / 2)
                said = self._diagnosis()
            return said
        except Exception as exc:
            return self._store_unreachable(exc)

    def _diagnosis(self) -> str:
        failed = {r: self._get(f"overlap/failed/{r}") for r in range(self.world)
                  if r != self.rank and self.store.check([f"overlap/failed/{r}"])}
        views = {r: self._view(r) for r in range(self.world)}
        return diagnosis(self.rank, views, failed, time.time(), self.interval)

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _get(self, key: str) -> str:
        return self.store.get(key).decode()

    def _view(self, r: int) -> PeerView:
        """What the store holds of rank ``r`` (`PeerView`), its process's state where it runs on this host."""
        last, beat_at, alive_at, steps, process = "start", None, None, None, None
        if self._has(f"overlap/progress/{r}"):
            last, at = self._get(f"overlap/progress/{r}").rsplit("@", 1)
            beat_at = float(at)
        if self._has(f"overlap/alive/{r}"):
            at, count = self._get(f"overlap/alive/{r}").split()
            alive_at, steps = float(at), int(count)
        if r != self.rank and self._has(f"overlap/pid/{r}"):
            host, pid = self._get(f"overlap/pid/{r}").rsplit(" ", 1)
            process = process_state(host, int(pid))
        return PeerView(alive_at, steps, last, beat_at, process)

    def _store_unreachable(self, exc: Exception) -> str:
        """The store is gone: torchrun's agent's (the launcher is gone), or rank 0's (never this rank's fault)."""
        if self.agent is not None:
            return f"the rendezvous store (torchrun's agent at {self.agent}) is unreachable: the launcher is gone"
        holder = ": rank 0, which holds it, is probably gone" if self.rank != 0 else ""
        return f"the rendezvous store is unreachable ({type(exc).__name__}){holder}"


FAULT_KINDS = ("exit", "hang", "raise", "nan", "inf")


def _fault_fields(text: str) -> Dict[str, str]:
    """``$OVERLAP_FAULT``'s ``name=value`` items (rank, iter, kind); a `ValueError` naming a bad one."""
    fields: Dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in ("rank", "iter", "kind"):
            raise ValueError(f"${ENV_FAULT}: {item!r} is not rank=N, iter=N or kind=K (e.g. rank=1,iter=2,kind=exit)")
        fields[name] = value.strip()
    return fields


def _fault_int(fields: Dict[str, str], name: str, default: int) -> int:
    """The integer ``name`` of ``$OVERLAP_FAULT``'s ``fields``, ``default`` where absent."""
    if name not in fields:
        return default
    try:
        return int(fields[name])
    except ValueError:
        raise ValueError(f"${ENV_FAULT}: {name}={fields[name]} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class Fault:
    """An injected fault: ``rank`` does ``kind`` (exit, hang or raise) before its ``at``-th iteration
    (``at=-1``: before it joins the process group), or (``nan``, ``inf``) holds a non-finite weight."""

    rank: int = 1
    at: int = 0
    kind: str = "exit"

    @classmethod
    def from_env(cls) -> Optional["Fault"]:
        """``$OVERLAP_FAULT="rank=1,iter=2,kind=exit|hang|raise|nan|inf"``, or None."""
        text = os.environ.get(ENV_FAULT)
        if not text:
            return None
        spec = _fault_fields(text)
        kind = spec.get("kind", "exit")
        if kind not in FAULT_KINDS:
            raise ValueError(f"${ENV_FAULT}: kind={kind} is not a fault (one of {'|'.join(FAULT_KINDS)})")
        return cls(_fault_int(spec, "rank", 1), _fault_int(spec, "iter", 0), kind)

    def poison(self, rank: int, model: MoEModel) -> None:
        """Kinds ``nan`` / ``inf``: this rank's model gets a non-finite weight, the final norm's (every output row
        reads it)."""
        if rank == self.rank and self.kind in ("nan", "inf"):
            with torch.no_grad():
                model.final_norm.weight[0] = float(self.kind)

    def maybe_fail(self, rank: int, iteration: int) -> None:
        if rank != self.rank or iteration != self.at:
            return
        if self.kind == "exit":
            os._exit(17)
        if self.kind == "hang":
            time.sleep(3600)
        if self.kind in ("nan", "inf"):
            return
        raise RuntimeError(f"injected fault on rank {rank} at iteration {iteration}")
