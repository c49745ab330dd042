"""How a rank of a multi-rank job leaves: once every rank is done, and without the interpreter's teardown.

`leave_group` waits for the toolkit's work in flight, meets every rank and destroys the process group.
`exit_rank` does that and ends the process, the way the launchers end theirs: the atexit handlers run and the
output is flushed, then the process exits with its status without the interpreter's teardown.

Why not the teardown: ``dist.destroy_process_group()`` stops gloo's threads only when nothing else holds the
group, and an expert-parallel model holds it. A gloo thread still alive when the interpreter tears down can end
inside a destructor that may not throw, and the process aborts ("terminate called without an active exception",
SIGABRT) after a program that succeeded (docs/reliability.md, "Leaving"). Leaving without the teardown, once every
rank is done, removes the window.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import traceback
from typing import NoReturn, Optional

import torch.distributed as dist

from .state import MAX_WAIT_TIMEOUT, WaitTimeout, raise_hint, wait_timeout
from .streams import synchronize


def leave_group(timeout: Optional[float] = None) -> None:
    """Leave the process group once every rank is done: the toolkit's work in flight waited for (`synchronize`),
    every rank met at a barrier bounded by ``timeout`` seconds (default: `wait_timeout`), then every group destroyed
    (``dist.destroy_process_group()``). Without a group, only the wait. `WaitTimeout` when a rank does not come."""
    bound = wait_timeout() if timeout is None else timeout
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound <= MAX_WAIT_TIMEOUT:
        raise ValueError(f"leave_group(timeout): a number of seconds > 0 (at most {MAX_WAIT_TIMEOUT:g}), got {timeout!r}")
    synchronize()
    if not dist.is_initialized():
        return
    try:
        dist.barrier(timeout=datetime.timedelta(seconds=bound))
    except RuntimeError as exc:  # gloo's: the bound ran out, or a peer's connection closed
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise WaitTimeout(f"rank {dist.get_rank()}: the ranks did not all come to leave the group within {bound:g} s "
                          f"(a rank that failed, or one still running: {first}); {raise_hint()}") from exc
    dist.destroy_process_group()


def exit_rank(status: int = 0) -> NoReturn:
    """End this rank's process with ``status`` (an exit status, 0-255); the end of a multi-rank program.

    With 0, once every rank is done (`leave_group`); with any other status at once, since the peers may be gone.
    Then what a normal exit does (threads that are not daemons joined, the atexit handlers run, stdout and stderr
    flushed), but not the interpreter's teardown, where gloo's threads can abort a process that succeeded (the
    module docstring): code after it does not run, and a file left open is not flushed. A rank that cannot leave
    the group says why (the traceback) and exits with 1."""
    if not isinstance(status, int) or isinstance(status, bool) or not 0 <= status <= 255:
        raise ValueError(f"exit_rank(status): an exit status from 0 to 255, got {status!r}")
    if status == 0:
        try:
            leave_group()
        except Exception:
            traceback.print_exc()
            status = 1
    exit_steps()
    os._exit(status)


def exit_steps() -> None:
    """What a normal exit does before the interpreter's teardown: the threads that are not daemons joined, the
    atexit handlers run, stdout and stderr flushed (`exit_rank` then leaves with ``os._exit``)."""
    try:
        threading._shutdown()  # the interpreter's own first step at exit: join the threads that are not daemons
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


__all__ = ["exit_rank", "exit_steps", "leave_group"]
