"""`run_ranks` under torchrun: the ranks torchrun made, one group per call, results through the store.

Every rank of the job goes through every call, participant or not, so a call has the same
contract as with spawned ranks: every rank gets every participant's result in rank order, and
a failure, skip or hang on one participant is raised on every rank. Nothing here issues a
collective on the job's default group: ranks first agree through torchrun's store that they are
at the same call (the same body on the same number of ranks), so a rank that is out of step is
named instead of cross-matching collectives with its peers. Every wait is bounded.

Groups: on gloo each call gets a fresh group, so a collective a failed peer left unmatched can
never pair with a later call's. On NCCL / HCCL, where a communicator is costly, the group of each
size is kept and dropped as soon as a call on it fails.

Liveness: every rank posts a heartbeat to the store (a counter, from a thread and a store client of
its own, so it goes on while the rank computes or waits). A rank waiting for its peers names one
whose heartbeat has not moved for ``$OVERLAP_RANK_TIMEOUT`` seconds (a frozen, dead or unreachable
rank: `RankTimeout`, "rank 1 stopped responding"), however long the wait's own bound, and every
later wait on it fails at once. Time is each rank's own clock: nodes need not agree on the time.
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import threading
import time
import traceback
import unittest
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .ranks import (ENV_TIMEOUT, RankContext, RankFailure, RankTimeout, default_device, default_pg_backend,
                    default_timeout)

_calls = itertools.count()  # per process, never reset: every rank counts the same calls
_kept_groups: Dict[int, Any] = {}  # size -> group, on device backends
_abandoned: List[Any] = []  # groups a failed call left behind: never reused, never destroyed mid-flight
_in_body = 0  # > 0 while a run_ranks body runs (see hide_group_outside_bodies)
_SECONDARY = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")
_ALIVE = "alive"  # store key prefix of the heartbeats
_POLL_MAX_S = 0.05  # longest pause between two looks at the store while waiting


class _Heartbeat:
    """This rank's sign of life: a counter posted under ``alive/<rank>`` every ``interval`` seconds, from a
    thread with a store client of its own (a long wait on the main client would hold a shared one)."""

    def __init__(self, store: Any, rank: int, interval: float) -> None:
        self._store, self._key, self._interval = store, f"{_ALIVE}/{rank}", interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="overlap-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beats = 0
        while True:
            beats += 1
            try:
                self._store.set(self._key, str(beats))
            except Exception:  # the store is gone: the job is ending
                return
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)


class _Liveness:
    """When this rank last saw each peer's heartbeat move, by its own clock, and the peers it found silent."""

    def __init__(self) -> None:
        self._seen: Dict[int, Tuple[Optional[bytes], float]] = {}
        self.lost: Dict[int, float] = {}  # rank -> seconds it had been silent when found so

    def silent(self, store: Any, ranks: Iterable[int], limit: float) -> Dict[int, float]:
        """The ranks of ``ranks`` whose heartbeat has not moved for more than ``limit`` s since this rank
        first saw it where it is (with how long), remembered as lost for good."""
        now, ranks = time.monotonic(), list(ranks)
        for r in ranks:
            if r in self.lost:
                continue
            key = f"{_ALIVE}/{r}"
            beat = store.get(key) if store.check([key]) else None
            seen = self._seen.get(r)
            if seen is None or seen[0] != beat:
                self._seen[r] = (beat, now)
            elif now - seen[1] > limit:
                self.lost[r] = now - seen[1]
        return {r: self.lost[r] for r in ranks if r in self.lost}


_heartbeat: Optional[_Heartbeat] = None
_liveness = _Liveness()


def lost_ranks() -> Dict[int, float]:
    """The peers this rank found silent for longer than ``$OVERLAP_RANK_TIMEOUT`` (rank -> seconds silent)."""
    return dict(_liveness.lost)


def _silence_limit() -> float:
    return default_timeout()


def _start_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        store = store.clone()  # a client of its own (TCPStore); a store without clone is shared
    except Exception:
        pass
    _heartbeat = _Heartbeat(dist.PrefixStore("overlap/", store), dist.get_rank(),
                            interval=min(1.0, _silence_limit() / 10))


def _stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


class _Missing(RuntimeError):
    pass


def _joined() -> bool:
    return dist.distributed_c10d.is_initialized()  # the real state, even while it is hidden


def hide_group_outside_bodies() -> None:
    """Make ``torch.distributed.is_initialized()`` answer False outside `run_ranks` bodies.

    A test suite under torchrun then sees what it sees with spawned ranks: a test process with no
    process group (code that defaults to the world group runs single-process, rank 0), and bodies
    that run on the ranks torchrun made. torch's own internals do not go through this name.
    """
    dist.is_initialized = lambda: _in_body > 0 and _joined()


def ensure_initialized(timeout: float) -> None:
    """Join torchrun's job (its env:// rendezvous) once per process, on the current path's process-group backend."""
    if _joined():
        return
    pg_backend = default_pg_backend()
    if pg_backend in ("nccl", "hccl"):  # one card per rank: two ranks on one card fail inside the library
        kind = "cuda" if pg_backend == "nccl" else "npu"
        cards, local = getattr(torch, kind).device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > cards:
            raise RuntimeError(f"{local} ranks on this node but {cards} {kind} card(s): {pg_backend} needs one card "
                               f"per rank (torchrun --nproc-per-node {cards} or fewer)")
    _silence_limit()  # a bad $OVERLAP_RANK_TIMEOUT is refused before joining, naming the variable
    default_device()  # selects this rank's card (LOCAL_RANK)
    dist.init_process_group(pg_backend, timeout=datetime.timedelta(seconds=timeout))
    atexit.register(_leave_together)
    _start_heartbeat()


def _leave_together() -> None:
    """At exit, wait for the other ranks and tear the groups down: a rank that leaves while others
    still use a group, or with gloo threads alive, aborts ("terminate called ...")."""
    try:
        if _joined():
            from .streams import synchronize

            synchronize()  # nothing of this rank's still in flight on a side stream
            live = [r for r in range(dist.get_world_size()) if r not in _liveness.lost]
            exchange("exit", True, live, timeout=60.0)  # the ranks that still answer leave together
            _stop_heartbeat()
            if len(live) == dist.get_world_size():
                dist.destroy_process_group()
    except Exception:  # a peer is gone already: nothing left to wait for
        pass


def _store() -> Any:
    return dist.PrefixStore("overlap/", dist.distributed_c10d._get_default_store())


def _stopped_responding(silent: Dict[int, float], key: str) -> str:
    who = ", ".join(f"rank {r}" for r in sorted(silent))
    return (f"{who} stopped responding: no sign of life for {max(silent.values()):.0f} s ({ENV_TIMEOUT} "
            f"{_silence_limit():g} s; frozen, dead, or its node unreachable), while waiting for it at {key!r}")


def exchange(key: str, value: Any, ranks: Iterable[int], timeout: float, post: bool = True) -> Dict[int, Any]:
    """Post this rank's ``value`` under ``key`` (unless ``post`` is False) and return the value of every
    rank in ``ranks``, waiting at most ``timeout`` seconds; `RankTimeout` names the ranks that never posted,
    and, at once, a rank whose heartbeat stopped for ``$OVERLAP_RANK_TIMEOUT`` seconds (see the module
    docstring)."""
    store, ranks = _store(), list(ranks)
    if post:
        store.set(f"{key}/{dist.get_rank()}", pickle.dumps(value))
    keys = {r: f"{key}/{r}" for r in ranks}
    limit = _silence_limit()
    deadline, pause = time.monotonic() + timeout, 0.001
    missing = list(ranks)
    # polled, not one long store.wait: a waiting rank must watch its peers' heartbeats
    while True:
        missing = [r for r in missing if not store.check([keys[r]])]
        if not missing:
            break
        silent = _liveness.silent(store, [r for r in missing if r != dist.get_rank()], limit)
        if silent:
            raise RankTimeout(_stopped_responding(silent, key), missing=sorted(silent))
        if time.monotonic() > deadline:
            raise RankTimeout(f"ranks {missing} of {len(ranks)} did not reach {key!r} within {timeout:.0f}s "
                              f"(alive, but hung in a collective or running other code)", missing=missing)
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    return {r: pickle.loads(store.get(keys[r])) for r in ranks}


def forget(key: str) -> None:
    """Drop this rank's value under ``key`` (once every rank has read it)."""
    try:
        _store().delete_key(f"{key}/{dist.get_rank()}")
    except RuntimeError:
        pass


def _group(n: int, timeout: float, pg_backend: str) -> Any:
    if pg_backend != "gloo" and n in _kept_groups:
        return _kept_groups[n]
    # every rank of the job creates every group, in the same order (the calls are agreed); never the
    # world group itself, so that a group a failed call leaves behind can be dropped
    group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=timeout))
    if pg_backend != "gloo":
        _kept_groups[n] = group
    return group


def _release(group: Any, n: int, failed: bool, pg_backend: str) -> None:
    if failed:
        _kept_groups.pop(n, None)
        _abandoned.append(group)  # a peer may still be inside a collective on it
    elif pg_backend == "gloo" and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _body(fn: Callable[..., Any], ctx: Any, env: Dict[str, str], args: tuple, kwargs: dict) -> Tuple[str, Any]:
    from .observability import enable_from_env
    from .state import STATE
    from .streams import synchronize

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    global _in_body
    had_sanitizer = STATE.sanitizer is not None
    observers = list(STATE.observers)
    _in_body += 1
    try:
        enable_from_env()  # as a spawned rank does, with ``env`` applied
        out = fn(ctx, *args, **kwargs)
        synchronize()
        return "ok", pickle.dumps(_to_cpu(out))
    except unittest.SkipTest as e:
        return "skip", str(e)
    except Exception as e:
        if type(e).__name__ == "Skipped":  # pytest.skip inside the body
            return "skip", str(e)
        return "error", traceback.format_exc()
    finally:
        _in_body -= 1
        # a spawned rank's process ends with its body: so do the observers the body installed
        if not had_sanitizer and STATE.sanitizer is not None:  # started by the call's env
            STATE.sanitizer.__exit__(None, None, None)
            STATE.sanitizer = None
        with STATE.lock:
            STATE.observers = [o for o in STATE.observers if any(o is p for p in observers)]
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _primary_first(errors: Dict[int, str]) -> List[Tuple[int, str]]:
    """Failed ranks, those whose error is not just a peer having left first."""
    return sorted(errors.items(), key=lambda item: (any(s in item[1] for s in _SECONDARY), item[0]))


def run(fn: Callable[..., Any], n: int, timeout: float, env: Dict[str, str], args: tuple, kwargs: dict) -> List[Any]:
    """`run_ranks` on the first ``n`` ranks of the torchrun job; see the module docstring."""
    ensure_initialized(timeout)
    pg_backend = default_pg_backend()
    world, me = dist.get_world_size(), dist.get_rank()
    seq = next(_calls)
    what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)} on {n} ranks"
    calls = exchange(f"call/{seq}", what, range(world), timeout)
    if seq:
        forget(f"call/{seq - 1}")
        forget(f"result/{seq - 1}")
    if len(set(calls.values())) > 1:
        listed = "; ".join(f"rank {r}: {c}" for r, c in sorted(calls.items()))
        raise RankFailure(f"the ranks are out of step, at different run_ranks calls ({listed}); no collective "
                          f"was issued")
    if n > world:
        raise unittest.SkipTest(f"needs {n} ranks, torchrun started {world}")
    group = _group(n, timeout, pg_backend)
    outcome: Optional[Tuple[str, Any]] = None
    if me < n:
        outcome = _body(fn, RankContext(me, n, group, default_device()), env, args, kwargs)
    # a participant stuck in a collective a failed peer never joins gives up after the group's timeout
    try:
        outcomes = exchange(f"result/{seq}", outcome, range(n), timeout * 1.5 + 30, post=me < n)
    except RankTimeout as e:
        _release(group, n, failed=True, pg_backend=pg_backend)
        if outcome is not None and outcome[0] == "error":  # what this rank saw of it, often the cause's effect
            raise RankTimeout(f"{e}; rank {me} of {n} failed meanwhile:\n{outcome[1]}", missing=e.missing) from None
        raise
    errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
    _release(group, n, failed=bool(errors), pg_backend=pg_backend)
    if errors:
        text = "\n".join(f"rank {r} of {n} failed:\n{tb}" for r, tb in _primary_first(errors))
        raise RankFailure(text)
    skips = {r: o[1] for r, o in outcomes.items() if o[0] == "skip"}
    if skips:
        r, reason = min(skips.items())
        raise unittest.SkipTest(f"{reason} (on rank {r})")
    return [pickle.loads(outcomes[r][1]) for r in range(n)]
