"""The ``aclgraph`` path: torchair's captured ACL graph (``mode="reduce-overhead"`` / npugraph_ex).

Streams are real inside the captured graph, so every cross-stream edge is a tagged event
(``air.tagged_event_record / wait``), and a tensor used on a side stream is recorded there with
``torchair.ops.npu_record_tagged_stream``. ``npu_wait_tensor`` raises on this path.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..context import eager_in_trace
from ..state import STATE
from ._torchair import TorchairBackend


@eager_in_trace
def _tagged_event(tag: str) -> str:
    """Create torchair's tagged event for ``tag`` once, as plain Python even under Dynamo; returns the tag.

    ``torchair.ops.npu_tagged_event_record/wait(event)`` map the event back to its tag and emit
    ``air.tagged_event_record/wait(tag)``; this path emits those ops with the tag itself, since
    Dynamo cannot trace torchair's lock-guarded event registry.
    """
    with STATE.lock:
        if tag not in STATE.tagged_events:
            from torchair.ops import npu_create_tagged_event

            STATE.tagged_events[tag] = npu_create_tagged_event(tag)
    return tag


class AclGraphBackend(TorchairBackend):
    name = "aclgraph"
    torchair_mode = "reduce-overhead"

    def record(self, event: Any) -> None:
        tag = _tagged_event(event.tag)  # first: it registers the air ops
        torch.ops.air.tagged_event_record(tag)

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        tag = _tagged_event(event.tag)
        torch.ops.air.tagged_event_wait(tag)
        return consumers

    def wait_tensor(self, x: torch.Tensor, deps: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("wait_tensor has no aclgraph lowering (npu_wait_tensor raises there): use event()")

    def record_stream(self, tensor: torch.Tensor, tag: str) -> None:
        from torchair.ops import npu_record_tagged_stream

        npu_record_tagged_stream(tensor, tag)
