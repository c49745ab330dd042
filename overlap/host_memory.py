"""Freed host memory kept for reuse, as a device's caching allocator keeps it: the CPU path's stand-in.

A device's caching allocator keeps the blocks a step frees and hands them to the next step. glibc's
malloc does not, by default, for large blocks: one over its mmap threshold (128 KiB at first,
raised as such blocks are freed, up to 32 MiB) is a mapping of its own, given back to the OS when
freed, and the heap's free top is given back too once over the trim threshold (twice the mmap one).
Where the sizes change between steps, as in a calibration that runs every mode at every token count
in turn, every large tensor is then faulted in afresh, page by page. Measured on 2 CPU ranks (small
preset, 256 tokens per rank, 1000 GB/s link, 2026-12-04): the decode calibration's serial step took
76-78 ms against 46-51 ms in a generation's steady state (571k minor faults), so auto predicted a
split mode 1.37x where it measured 0.90x; with the memory kept, 47 ms and 0.89-0.91x predicted
(80k faults).

`keep_freed_memory` sets glibc's mmap threshold to its ceiling (blocks up to 32 MiB come from the
heap) and its trim threshold to 1 GiB (freed heap memory stays with the process): freed blocks are
reused as a device's allocator reuses them, and the process keeps what it once held, as a device's
does. The launchers on ``--device cpu``, the benchmarks' ranks and the calibrations on the CPU path
call it, and a calibration's cache key holds the setting (`freed_memory_setting`).
``$OVERLAP_CPU_KEEP_MEMORY=0`` (or ``off``) leaves glibc's defaults; where the C library is not glibc
it does nothing.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

from .context import env_switch

ENV_KEEP_MEMORY = "OVERLAP_CPU_KEEP_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_CEILING = 32 << 20  # the largest mmap threshold glibc takes on 64-bit hosts
_TRIM = 1 << 30
_kept: Optional[str] = None  # what the first call did, once it did it


def _glibc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def env_keep_memory() -> Optional[bool]:
    """``$OVERLAP_CPU_KEEP_MEMORY``: False for 0 / false / off / no, True for 1 / true / on / yes, None when unset or
    empty; ValueError naming it otherwise (`overlap.context.env_switch`)."""
    return env_switch(ENV_KEEP_MEMORY, "freed host memory kept, the default", "glibc's defaults")


def _switched_off() -> bool:
    return env_keep_memory() is False


def freed_memory_setting() -> str:
    """What `keep_freed_memory` does in this process, in a word (a calibration's cache key holds it): ``kept``, or
    ``default`` where it is switched off or the C library is not glibc."""
    return "default" if _switched_off() or _glibc() is None else "kept"


def keep_freed_memory() -> str:
    """Keep freed host memory for reuse (see the module docstring), once per process; returns what it did, in words."""
    global _kept
    if _switched_off():
        return f"glibc's defaults (${ENV_KEEP_MEMORY}=0)"
    if _kept is not None:
        return _kept
    libc = _glibc()
    if libc is None:
        _kept = "left as it is (not glibc)"
    elif libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_CEILING) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM) == 1:
        _kept = "freed memory kept (glibc: no mmap up to 32 MiB, no trim under 1 GiB)"
    else:
        _kept = "left as it is (glibc refused mallopt)"
    return _kept


def keep_on_host_path() -> None:
    """`keep_freed_memory` where the current path computes on the host (a calibration's steps run every size in
    turn: kept, they measure what a device's allocator would give them, not page faults); elsewhere nothing."""
    from . import backends

    if backends.current().device_type == "cpu":
        keep_freed_memory()


__all__ = ["ENV_KEEP_MEMORY", "env_keep_memory", "freed_memory_setting", "keep_freed_memory", "keep_on_host_path"]
