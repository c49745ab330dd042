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
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import traceback
import unittest
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

_calls = itertools.count()  # per process, never reset: every rank counts the same calls
_kept_groups: Dict[int, Any] = {}  # size -> group, on device backends
_abandoned: List[Any] = []  # groups a failed call left behind: never reused, never destroyed mid-flight
_in_body = 0  # > 0 while a run_ranks body runs (see hide_group_outside_bodies)
_SECONDARY = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")


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
    """Join torchrun's job (its env:// rendezvous) once per process, on the current path's backend."""
    from .multirank import default_backend, default_device

    if _joined():
        return
    backend = default_backend()
    if backend in ("nccl", "hccl"):  # one card per rank: two ranks on one card fail inside the library
        kind = "cuda" if backend == "nccl" else "npu"
        cards, local = getattr(torch, kind).device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > cards:
            raise RuntimeError(f"{local} ranks on this node but {cards} {kind} card(s): {backend} needs one card "
                               f"per rank (torchrun --nproc-per-node {cards} or fewer)")
    default_device()  # selects this rank's card (LOCAL_RANK)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    atexit.register(_leave_together)


def _leave_together() -> None:
    """At exit, wait for the other ranks and tear the groups down: a rank that leaves while others
    still use a group, or with gloo threads alive, aborts ("terminate called ...")."""
    try:
        if _joined():
            from .streams import synchronize

            synchronize()  # nothing of this rank's still in flight on a side stream
            exchange("exit", True, range(dist.get_world_size()), timeout=60.0)
            dist.destroy_process_group()
    except Exception:  # a peer is gone already: nothing left to wait for
        pass


def _store() -> Any:
    return dist.PrefixStore("overlap/", dist.distributed_c10d._get_default_store())


def exchange(key: str, value: Any, ranks: Iterable[int], timeout: float, post: bool = True) -> Dict[int, Any]:
    """Post this rank's ``value`` under ``key`` (unless ``post`` is False) and return the value of every
    rank in ``ranks``, waiting at most ``timeout`` seconds; `RankTimeout` names the ranks that never posted."""
    from .multirank import RankTimeout

    store, ranks = _store(), list(ranks)
    if post:
        store.set(f"{key}/{dist.get_rank()}", pickle.dumps(value))
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: some never posted
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not missing:
            raise
        raise RankTimeout(f"ranks {missing} of {len(ranks)} did not reach {key!r} within {timeout:.0f}s "
                          f"(dead, hung in a collective, or running other code)") from None
    return {r: pickle.loads(store.get(k)) for r, k in zip(ranks, keys)}


def forget(key: str) -> None:
    """Drop this rank's value under ``key`` (once every rank has read it)."""
    try:
        _store().delete_key(f"{key}/{dist.get_rank()}")
    except RuntimeError:
        pass


def _group(n: int, timeout: float, backend: str) -> Any:
    if backend != "gloo" and n in _kept_groups:
        return _kept_groups[n]
    # every rank of the job creates every group, in the same order (the calls are agreed); never the
    # world group itself, so that a group a failed call leaves behind can be dropped
    group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=timeout))
    if backend != "gloo":
        _kept_groups[n] = group
    return group


def _release(group: Any, n: int, failed: bool, backend: str) -> None:
    if failed:
        _kept_groups.pop(n, None)
        _abandoned.append(group)  # a peer may still be inside a collective on it
    elif backend == "gloo" and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
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
    from .multirank import RankContext, RankFailure, default_backend, default_device

    ensure_initialized(timeout)
    backend = default_backend()
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
    group = _group(n, timeout, backend)
    outcome: Optional[Tuple[str, Any]] = None
    if me < n:
        outcome = _body(fn, RankContext(me, n, group, default_device()), env, args, kwargs)
    # a participant stuck in a collective a failed peer never joins gives up after the group's timeout
    outcomes = exchange(f"result/{seq}", outcome, range(n), timeout * 1.5 + 30, post=me < n)
    errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
    _release(group, n, failed=bool(errors), backend=backend)
    if errors:
        text = "\n".join(f"rank {r} of {n} failed:\n{tb}" for r, tb in _primary_first(errors))
        raise RankFailure(text)
    skips = {r: o[1] for r, o in outcomes.items() if o[0] == "skip"}
    if skips:
        r, reason = min(skips.items())
        raise unittest.SkipTest(f"{reason} (on rank {r})")
    return [pickle.loads(outcomes[r][1]) for r in range(n)]
