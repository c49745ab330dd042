"""One backend per execution path, behind one interface (`Backend`); `current()` is the one in use.

=============  ==========================================  ===============================
path           stream / event / ordering                   file
=============  ==========================================  ===============================
``cpu``        logical streams, gloo async, copy threads   ``cpu.py``
``cuda``       ``torch.cuda`` streams and events           ``device.py``
``npu``        ``torch.npu`` streams, events, core limits  ``device.py``
``ge``         torchair scopes, ``npu_wait_tensor``        ``ge.py``
``aclgraph``   npugraph_ex scopes, tagged events           ``aclgraph.py``
=============  ==========================================  ===============================

Code outside this package never compares path names: it asks the backend (`Backend`'s
capability flags and methods). A new path is one new file and one entry below.
"""
from __future__ import annotations

from typing import Dict

from ..context import check_path, current_path
from .aclgraph import AclGraphBackend
from .base import Ahead, Backend
from .cpu import CpuBackend, CpuStream
from .device import DeviceBackend
from .ge import GeBackend
from .ge_reorder import ge_hazards, pin_cheap_consumers

_BACKENDS: Dict[str, Backend] = {
    "cpu": CpuBackend(),
    "cuda": DeviceBackend("cuda"),
    "npu": DeviceBackend("npu"),
    "ge": GeBackend(),
    "aclgraph": AclGraphBackend(),
}


def get(path: str) -> Backend:
    """The backend of execution path ``path``."""
    return _BACKENDS[check_path(path, "overlap.backends.get()")]


def current() -> Backend:
    """The backend of the current execution path (`overlap.current_path`)."""
    return _BACKENDS[current_path()]


__all__ = ["Ahead", "Backend", "CpuStream", "current", "ge_hazards", "get", "pin_cheap_consumers"]
