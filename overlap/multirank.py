"""Run a function on N ranks: spawned gloo processes on one machine, or the ranks torchrun made.

Tests call ``run_ranks(body, n, *args)``. Without torchrun it starts ``n`` processes joined by a
gloo group over a file store, returns each rank's result in rank order, re-raises the first
failure with that rank's traceback, and turns a hang into `RankTimeout` naming the ranks that
did not finish. Under torchrun (``WORLD_SIZE`` set) the same call runs ``body`` on the first
``n`` ranks of the existing job (HCCL / NCCL / gloo) and returns the same thing on every rank
(see `overlap._torchrun`), so the test suite doubles as the multi-node regression suite:
``torchrun --nnodes 2 --nproc-per-node 8 -m pytest tests``.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import backends
from .observability import enable_from_env
from .streams import synchronize

ENV_TIMEOUT = "OVERLAP_RANK_TIMEOUT"
ENV_START_METHOD = "OVERLAP_START_METHOD"
DEFAULT_RANK_TIMEOUT_S = 90.0
_MAX_SECONDS = 1e7  # ~115 days: beyond it a bound is a typo (and overflows timedelta arithmetic)


def seconds_from_env(name: str, default: float) -> float:
    """The number of seconds in ``$name`` (``default`` when unset or empty); `ValueError` naming the
    variable when it is not a finite number of seconds > 0."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= _MAX_SECONDS):  # NaN fails too
        raise ValueError(f"{name}={text!r}: expected a number of seconds > 0 (at most {_MAX_SECONDS:g}); "
                         f"unset, it is {default:g}")
    return value


def default_timeout() -> float:
    """The bound of a multi-rank call and of a silent peer: ``$OVERLAP_RANK_TIMEOUT`` seconds, 90 by default
    (read at each call; `ValueError` naming the variable when it is not a positive number)."""
    return seconds_from_env(ENV_TIMEOUT, DEFAULT_RANK_TIMEOUT_S)


class RankFailure(RuntimeError):
    """A rank raised; the message carries its traceback."""


class RankTimeout(RuntimeError):
    """Some ranks did not finish in time (a hang, most often a collective issued on some ranks only), or
    stopped responding; ``missing`` names them when known."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


@dataclasses.dataclass
class RankContext:
    """What a rank's body gets: its rank, the group of the ranks taking part, and its device."""

    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]
    device: torch.device


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def default_backend() -> str:
    """The torch.distributed backend for the current path's device: gloo, nccl or hccl."""
    return backends.current().process_group_backend


def default_device() -> torch.device:
    """This rank's device under torchrun: ``LOCAL_RANK`` selects it on NPU / CUDA."""
    backend = backends.current()
    backend.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return backend.device()




def _child(fn: Callable[..., Any], rank: int, world: int, store_dir: str, timeout: float, threads: int,
           env: Dict[str, str], results: Any, args: tuple, kwargs: dict) -> None:
    os.environ.update(env)
    enable_from_env()  # with env applied: honour $OVERLAP_SANITIZE (and OVERLAP_SANITIZE passed in env)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        # gloo's mesh is connected pair by pair: a rank that finished and left before a peer was done
        # connecting would fail that peer's init, hiding what the body did
        dist.barrier()
        ctx = RankContext(rank, world, dist.group.WORLD, torch.device("cpu"))
        out = fn(ctx, *args, **kwargs)
        # plain pickle: the queue's pickler would pass tensors as shared-memory handles that die with this process
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                synchronize()
                dist.destroy_process_group()
        except Exception:
            pass


def _context() -> Any:
    method = os.environ.get(ENV_START_METHOD, "forkserver")
    if method not in mp.get_all_start_methods():
        raise ValueError(f"{ENV_START_METHOD}={method!r}: expected one of {', '.join(mp.get_all_start_methods())}; "
                         f"unset, it is forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "overlap"])
    return ctx


def _crashed(procs: List[Any], exclude: int, within: float) -> Optional[int]:
    """A rank other than ``exclude`` whose process ended with a non-zero exit code, waiting up to ``within`` s."""
    end = time.monotonic() + within
    while True:
        for r, p in enumerate(procs):
            if r != exclude and not p.is_alive() and p.exitcode:
                return r
        if time.monotonic() > end:
            return None
        time.sleep(0.05)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: Optional[float] = None,
              threads: int = 1, env: Optional[Dict[str, str]] = None, **kwargs: Any) -> List[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks and return the results in rank order.

    ``fn`` must be importable (a module-level function) because ranks are separate processes.
    ``env`` is set in each rank before ``fn`` runs. Under torchrun ``fn`` runs on the first
    ``world_size`` ranks of the job, on a group of their own, and every rank of the job (taking
    part or not) gets the same list and the same `RankFailure`, `RankTimeout` or skip.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = default_timeout() if timeout is None else timeout
    if under_torchrun():
        from . import _torchrun

        return _torchrun.run(fn, world_size, timeout, dict(env or {}), args, kwargs)

    mpctx = _context()
    results = mpctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="overlap-ranks-")
    procs = [mpctx.Process(target=_child, name=f"rank{r}", daemon=True,
                           args=(fn, r, world_size, store_dir, timeout, threads, dict(env or {}), results,
                                 args, kwargs))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                crashed = _crashed(procs, exclude=-1, within=0.0)
                if crashed is not None:
                    time.sleep(0.5)  # its message may still be in the pipe
                    if results.empty():
                        raise RankFailure(f"rank {crashed} died with exit code {procs[crashed].exitcode} "
                                          f"without reporting (killed, or crashed in native code)")
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outputs]
                    raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                      f"(a hang: often a collective issued on some ranks only)")
                continue
            if status == "error":
                # A peer's crash often surfaces first as this rank's "connection closed": name the crash.
                crashed = _crashed(procs, exclude=rank, within=1.0)
                if crashed is not None:
                    raise RankFailure(f"rank {crashed} died with exit code {procs[crashed].exitcode} without "
                                      f"reporting (killed, or crashed in native code); then rank {rank} of "
                                      f"{world_size} failed:\n{payload}")
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outputs) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(store_dir, ignore_errors=True)
    return [outputs[r] for r in range(world_size)]
