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

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _torchrun
from .observability import enable_from_env
from .ranks import (DEFAULT_RANK_TIMEOUT_S, ENV_TIMEOUT, RankContext, RankFailure, RankTimeout, default_device,
                    default_pg_backend, default_timeout, seconds_from_env, under_torchrun)
from .streams import synchronize

# the rank basics live in `overlap.ranks` (the launcher imports them from there); the harness's
# users keep importing them from here
ENV_START_METHOD = "OVERLAP_START_METHOD"
# modules the forkserver imports once, beyond torch and overlap, so that each rank forked from it has them
# (a test suite whose rank bodies build transformers models saves their import in every rank)
ENV_PRELOAD = "OVERLAP_FORKSERVER_PRELOAD"
_PRELOAD = ("torch", "torch.distributed", "overlap")


def _child(fn: Callable[..., Any], rank: int, world: int, store_dir: str, timeout: float, threads: int,
           env: Dict[str, str], results: Any, args: tuple, kwargs: dict) -> None:
    # the caller's environment as it was at the call: a forkserver's children inherit the one it started with,
    # which can be an earlier caller's (a test's calibration cache folder, a variable removed since)
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
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
        ctx.set_forkserver_preload(list(_PRELOAD) + preload_modules())
    return ctx


def preload_modules() -> List[str]:
    """``$OVERLAP_FORKSERVER_PRELOAD``'s module names (comma-separated): ValueError naming it for a name that
    is not a dotted module path. The forkserver skips one it cannot import, as multiprocessing does."""
    names = [n.strip() for n in os.environ.get(ENV_PRELOAD, "").split(",") if n.strip()]
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise ValueError(f"{ENV_PRELOAD}={os.environ[ENV_PRELOAD]!r}: {bad[0]!r} is not a module name; expected "
                         f"comma-separated module names such as 'transformers,launch.engine'")
    return names


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
    Each rank runs in the caller's environment as it is at this call, with ``env`` set on top. Under torchrun ``fn`` runs on the first
    ``world_size`` ranks of the job, on a group of their own, and every rank of the job (taking
    part or not) gets the same list and the same `RankFailure`, `RankTimeout` or skip.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = default_timeout() if timeout is None else timeout
    if under_torchrun():
        return _torchrun.run(fn, world_size, timeout, dict(env or {}), args, kwargs)

    mpctx = _context()
    results = mpctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="overlap-ranks-")
    procs = [mpctx.Process(target=_child, name=f"rank{r}", daemon=True,
                           args=(fn, r, world_size, store_dir, timeout, threads, {**os.environ, **(env or {})},
                                 results, args, kwargs))
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


__all__ = ["DEFAULT_RANK_TIMEOUT_S", "ENV_PRELOAD", "ENV_START_METHOD", "ENV_TIMEOUT", "RankContext", "RankFailure",
           "RankTimeout", "default_device", "default_pg_backend", "default_timeout", "preload_modules", "run_ranks",
           "seconds_from_env", "under_torchrun"]
