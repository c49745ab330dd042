"""A rank of a multi-rank job: its process-group backend and device, how long it waits for its peers,
and the errors that name the ranks at fault.

Shared by the launcher (`launch.health` joins torchrun's group on `default_device` with
`default_pg_backend`) and the multi-rank harness of the tests and benchmarks (`overlap.multirank`,
`overlap._torchrun`), so that neither the launcher nor the harness's torchrun half imports the
harness: both import this module, which imports neither.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import backends

ENV_TIMEOUT = "OVERLAP_RANK_TIMEOUT"
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


def default_pg_backend() -> str:
    """The process-group backend (torch.distributed's) for the current path's device: gloo, nccl or hccl."""
    return backends.current().process_group_backend


def default_device() -> torch.device:
    """This rank's device under torchrun: ``LOCAL_RANK`` selects it on NPU / CUDA."""
    backend = backends.current()
    backend.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return backend.device()


__all__ = ["DEFAULT_RANK_TIMEOUT_S", "ENV_TIMEOUT", "RankContext", "RankFailure", "RankTimeout", "default_device",
           "default_pg_backend", "default_timeout", "seconds_from_env", "under_torchrun"]
