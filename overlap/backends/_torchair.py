"""What the two graph paths share: stream scopes, core-limit scopes, the NPU device.

Inside a graph a stream is a label (``torchair.scope.npu_stream_switch`` on ``ge``, npugraph_ex's
scope on ``aclgraph``): scopes only nest, so the main stream cannot be entered inside a side-stream
scope. Nothing is read on the host and launches are not seen one by one (profile with torch_npu's
profiler). torchair and npugraph_ex are imported only when a graph path is used.
"""
from __future__ import annotations

from typing import Any, ContextManager, Optional

import torch

from ..context import DEFAULT
from .base import Backend


class TorchairBackend(Backend):
    device_type = "npu"
    process_group_backend = "hccl"
    is_graph = True
    events_are_global = True
    has_npu_ops = True

    def device(self) -> torch.device:
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.device("npu", torch.npu.current_device())

    def set_device(self, local_rank: int) -> None:
        import torch_npu  # noqa: F401

        torch.npu.set_device(local_rank)

    def stream_scope(self, tag: str, priority: int, outer: str) -> Optional[ContextManager[Any]]:
        if tag == DEFAULT:  # outside any switch is the main stream already
            if outer != DEFAULT:
                raise ValueError(f"on the {self.name} path the main stream cannot be entered inside the {outer!r} "
                                 f"stream scope (torchair scopes only nest); end the side-stream block first")
            return None
        return self.stream_switch(tag, priority)

    def stream_switch(self, tag: str, priority: int) -> ContextManager[Any]:
        """The scope that places work on the side stream ``tag``."""
        from torchair.scope import npu_stream_switch

        return npu_stream_switch(tag, priority)

    def core_scope(self, aic: int, aiv: int) -> Optional[ContextManager[Any]]:
        from torchair.scope import limit_core_num

        return limit_core_num(aic, aiv)

    def soc_version(self) -> Optional[str]:
        try:
            return torch.npu.get_device_name()
        except Exception:
            return None
