"""The ``aclgraph`` path: a captured ACL graph, compiled by torch_npu's ``npugraph_ex`` backend.

torch_npu 2.13 deprecates torchair's ``mode="reduce-overhead"`` in favour of the ``npugraph_ex``
backend: ``torch.compile(fn, backend="npugraph_ex")`` (a ``torch_dynamo_backends`` entry point of
the wheel; `AclGraphBackend.compile_backend`). That backend reads its own operators,
``torch.ops.npugraph_ex.*``, and leaves ``air.*`` scopes alone, so this path lowers to them:

- a stream is an ``npugraph_ex.scope_enter(["_user_stream_label", "_user_stream_priority"], ...)``
  ... ``scope_exit`` block (npugraph_ex creates one stream per label and joins it at the graph's end);
- every cross-stream edge is a tagged event, ``npugraph_ex.tagged_event_record / wait(tag)``, the
  event created once per process in npugraph_ex's own registry;
- a tensor used on a side stream is ``npugraph_ex.record_tagged_stream_(tensor, tag)``;
- core limits are npugraph_ex's ``scope.limit_core_num`` (``_op_aicore_num`` / ``_op_vectorcore_num``).

``npu_wait_tensor`` has no lowering here. torchair's ``ops.record()`` / ``ops.wait(tensors)`` are not
used: see docs/graph-mode.md for why.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, ContextManager, Optional, Sequence

import torch

from ..context import eager_in_trace
from ..state import STATE
from ._torchair import TorchairBackend

NPUGRAPH_EX = "npugraph_ex"  # the package, the torch.compile backend and the operator namespace


@eager_in_trace
def _load() -> bool:
    """Import npugraph_ex's scope and event modules, which register ``torch.ops.npugraph_ex.*`` (once)."""
    if NPUGRAPH_EX not in sys.modules:
        import torch_npu  # noqa: F401  (installs the npugraph_ex package)
    importlib.import_module(f"{NPUGRAPH_EX}.scope")
    importlib.import_module(f"{NPUGRAPH_EX}.ops._tagged_event")
    return True


@eager_in_trace
def _tagged_event(tag: str) -> str:
    """Create npugraph_ex's tagged event for ``tag`` once, as plain Python even under Dynamo; returns the tag.

    ``tagged_event_record / wait(tag)`` find the event by its tag at run time. npugraph_ex 2.13 has
    no public creator (torchair's ``npu_create_tagged_event`` fills torchair's registry, which
    npugraph_ex does not read), hence its module's own function.
    """
    _load()
    with STATE.lock:
        if tag not in STATE.tagged_events:
            from npugraph_ex.ops._tagged_event import _npu_create_tagged_event

            STATE.tagged_events[tag] = _npu_create_tagged_event(tag)
    return tag


class _StreamScope:
    """``npugraph_ex.scope_enter`` with a stream label ... ``scope_exit``."""

    def __init__(self, tag: str, priority: int):
        self.keys = ["_user_stream_label", "_user_stream_priority"]
        self.values = [tag, str(priority)]

    def __enter__(self) -> None:
        _load()
        torch.ops.npugraph_ex.scope_enter(self.keys, self.values)

    def __exit__(self, *exc: Any) -> None:
        torch.ops.npugraph_ex.scope_exit()


class AclGraphBackend(TorchairBackend):
    name = "aclgraph"
    torchair_mode = NPUGRAPH_EX  # torchair's CompilerConfig name of this mode (no deprecation warning)

    def compile_backend(self) -> Any:
        return NPUGRAPH_EX

    def stream_switch(self, tag: str, priority: int) -> ContextManager[Any]:
        return _StreamScope(tag, priority)

    def core_scope(self, aic: int, aiv: int) -> Optional[ContextManager[Any]]:
        _load()
        from npugraph_ex.scope import limit_core_num

        return limit_core_num(aic, aiv)

    def record(self, event: Any) -> None:
        tag = _tagged_event(event.tag)  # first: it registers the npugraph_ex ops
        torch.ops.npugraph_ex.tagged_event_record(tag)

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        tag = _tagged_event(event.tag)
        torch.ops.npugraph_ex.tagged_event_wait(tag)
        return consumers

    def wait_tensor(self, x: torch.Tensor, deps: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("wait_tensor has no aclgraph lowering (npu_wait_tensor raises there): use event()")

    def record_stream(self, tensor: torch.Tensor, tag: str) -> None:
        _load()
        torch.ops.npugraph_ex.record_tagged_stream_(tensor, tag)
