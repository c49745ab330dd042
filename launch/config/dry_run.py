"""``--dry-run``: the job sized on paper over ``--nnodes`` x ``--nproc-per-node`` ranks, checked like every other
option before anything is built (`ConfigError`, exit status 2)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .errors import ConfigError

__all__ = ["DryRun", "dry_run_config"]


@dataclasses.dataclass(frozen=True)
class DryRun:
    """The ranks a dry run sizes the job for, and each rank's device memory (None: not said)."""

    nnodes: int
    nproc_per_node: int
    device_memory_gib: Optional[float] = None

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node


def _count(option: str, value: Optional[int]) -> int:
    """A count of torchrun's (default 1), at least 1."""
    if value is None:
        return 1
    if value < 1:
        raise ConfigError(f"{option} must be at least 1, got {value}")
    return value


def dry_run_config(dry_run: bool, nproc_per_node: Optional[int], nnodes: Optional[int],
                   device_memory: Optional[float]) -> Optional[DryRun]:
    """The dry run of ``--dry-run`` (None without it); `ConfigError` naming an option that only a dry run takes
    (torchrun's own ``--nnodes`` / ``--nproc-per-node`` belong to torchrun otherwise) or a bad value."""
    given = [f"{name} {value:g}" for name, value in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes),
                                                   ("--device-memory", device_memory)) if value is not None]
    if not dry_run:
        if given:
            raise ConfigError(f"{given[0]} is taken with --dry-run only: give torchrun its own --nnodes / "
                              f"--nproc-per-node (torchrun --nnodes 4 --nproc-per-node 8 launch/...), or add "
                              f"--dry-run to size the job on paper")
        return None
    if device_memory is not None and not (math.isfinite(device_memory) and device_memory > 0):
        raise ConfigError(f"--device-memory must be a positive number of GiB, got {device_memory:g}")
    return DryRun(_count("--nnodes", nnodes), _count("--nproc-per-node", nproc_per_node), device_memory)
