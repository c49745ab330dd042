"""Free TCP ports for tests that start torchrun: one range per xdist worker, below the ephemeral range.

Binding port 0 and releasing it leaves a window in which another process (another xdist worker,
or any socket's ephemeral port) takes the same port. Ports from 20000 up are not handed out as
ephemeral ports on Linux (32768-60999), and each worker draws from its own 400 of them, so two
workers never pick the same one; a port still bound or in TIME_WAIT is skipped.
"""
from __future__ import annotations

import itertools
import os
import socket

_BASE, _PER_WORKER = 20000, 400


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; absent without xdist
    digits = name[2:] if name.startswith("gw") else ""
    return int(digits) % 30 if digits.isdigit() else 0


_counter = itertools.count()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and no other test worker will pick."""
    start = _BASE + _worker_index() * _PER_WORKER
    for _ in range(_PER_WORKER):
        port = start + next(_counter) % _PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}..{start + _PER_WORKER - 1}")
