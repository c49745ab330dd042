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
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        w in text for w in ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl", "hccl"))


class Peers:
    """Heartbeats in the store, so that a rank stuck in a collective can name the rank that is gone."""

    def __init__(self) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def beat(self, what: str) -> None:
        self.store.set(f"overlap/progress/{self.rank}", f"{what}@{time.time():.3f}")

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
        """Which ranks failed or stopped making progress, in words."""
        try:
            others = [r for r in range(self.world) if r != self.rank]
            failed = [r for r in others if self.store.check([f"overlap/failed/{r}"])]
            if failed:
                return "; ".join(f"rank {r} failed: {self.store.get(f'overlap/failed/{r}').decode()}" for r in failed)
            beats = {}
            for r in range(self.world):
                if self.store.check([f"overlap/progress/{r}"]):
                    what, at = self.store.get(f"overlap/progress/{r}").decode().rsplit("@", 1)
                    beats[r] = (float(at), what)
            if not beats:
                return "no rank reported progress"
            oldest = min(beats.values())[0]
            stale = [r for r in range(self.world) if r not in beats or beats[r][0] <= oldest + 1e-3]
            return ", ".join(f"rank {r} stopped responding (last seen at {beats[r][1] if r in beats else 'start'})"
                             for r in stale if r != self.rank) or "peers are alive; the collective itself timed out"
        except Exception as exc:  # the store lives on rank 0: if that is gone, say so
            return f"the rendezvous store is unreachable ({type(exc).__name__}): rank 0 is probably gone"


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
