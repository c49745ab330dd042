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

import overlap
from microbatch.model import MoEModel
from overlap.peers import PeerView, PeerWatch, diagnosis, reads_as_peer_failure
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
    return isinstance(exc, dist.DistError) or reads_as_peer_failure(str(exc))


class Peers:
    """The launchers' view of their peers in the store: each rank's progress in words (`beat`), its failure
    (`failed`), and from `watch` on, its signs of life (`overlap.watch_peers`): a rank stopped (SIGSTOP) or hung
    holding the interpreter stops giving them, a rank waiting in a collective goes on. `diagnose` says, from all
    that, which rank is to blame."""

    def __init__(self) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._watch: Optional[PeerWatch] = None
        self.agent = (f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                      if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else None)

    def watch(self) -> None:
        """Signs of life from here on (`overlap.watch_peers`), so that `diagnose` tells a stopped rank from a
        waiting one."""
        self._watch = overlap.watch_peers()

    def beat(self, what: str) -> None:
        """This rank's progress, in words (said of it when it is late), and one more step for its watch (a prefill
        round, a calibration's: a rank that hangs there stays a step behind)."""
        overlap.peer_step()
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
        """Which ranks failed, stopped or fell behind, in words (`overlap.peers.diagnosis`; with a watch it reads
        the signs of life over `overlap.peers.STALE` intervals, so that a rank killed a moment ago is seen silent)."""
        try:
            failed = {r: self._get(f"overlap/failed/{r}") for r in range(self.world)
                      if r != self.rank and self.store.check([f"overlap/failed/{r}"])}
            views = self._watch.views() if self._watch is not None else {r: PeerView() for r in range(self.world)}
            return diagnosis(self.rank, {r: self._with_progress(r, v) for r, v in views.items()}, failed)
        except Exception as exc:
            return self._store_unreachable(exc)

    def _get(self, key: str) -> str:
        return self.store.get(key).decode()

    def _with_progress(self, r: int, view: PeerView) -> PeerView:
        """``view`` with rank ``r``'s last progress in words, and when it said so."""
        if not self.store.check([f"overlap/progress/{r}"]):
            return view
        last, at = self._get(f"overlap/progress/{r}").rsplit("@", 1)
        return dataclasses.replace(view, last=last, beat_at=float(at))

    def _store_unreachable(self, exc: Exception) -> str:
        """The store is gone: torchrun's agent's (the launcher is gone), or rank 0's (never this rank's fault)."""
        if self.agent is not None:
            return f"the rendezvous store (torchrun's agent at {self.agent}) is unreachable: the launcher is gone"
        holder = ": rank 0, which holds it, is probably gone" if self.rank != 0 else ""
        return f"the rendezvous store is unreachable ({type(exc).__name__}){holder}"


FAULT_KINDS = ("exit", "hang", "raise", "nan", "inf", "scale")


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
    (``at=-1``: before it joins the process group), or (``nan``, ``inf``) holds a non-finite weight, or
    (``scale``) computes with a quantized expert's scales doubled."""

    rank: int = 1
    at: int = 0
    kind: str = "exit"

    @classmethod
    def from_env(cls) -> Optional["Fault"]:
        """``$OVERLAP_FAULT="rank=1,iter=2,kind=exit|hang|raise|nan|inf|scale"``, or None."""
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
        reads it); ``scale``: its first quantized experts' first expert computes with its down projection's scales
        doubled (a wrong answer finite and near the right one, which only ``--check`` of a quantized checkpoint
        sees; nothing for float weights, nor for ``--quantize``'s, quantized after this)."""
        if rank != self.rank:
            return
        with torch.no_grad():
            if self.kind in ("nan", "inf"):
                model.final_norm.weight[0] = float(self.kind)
            if self.kind == "scale":
                from collectives import QuantizedExperts

                experts = next((m for m in model.modules() if isinstance(m, QuantizedExperts)), None)
                if experts is not None:
                    experts.scales("down", 0)[0].mul_(2)

    def maybe_fail(self, rank: int, iteration: int) -> None:
        if rank != self.rank or iteration != self.at:
            return
        if self.kind == "exit":
            os._exit(17)
        if self.kind == "hang":
            time.sleep(3600)
        if self.kind in ("nan", "inf", "scale"):  # a poisoned weight: `poison`
            return
        raise RuntimeError(f"injected fault on rank {rank} at iteration {iteration}")
