"""The ``ge`` path: torchair's GE graph (``mode="max-autotune"``).

GE honours data edges across streams, so a value read on another stream needs nothing; an
ordering edge without data is ``torchair.scope.npu_wait_tensor(consumer, dependency)``, whose
result the consumer must use. GE has no events: an event's wait becomes that edge from every
tensor its record guarded to every consumer. Tagged streams need no ``record_stream`` (GE plans
memory across streams).

GE also reorders: a cheap consumer of a side output left on the main stream may be issued there ahead of the
main path's long operation and stall it (`overlap.backends.ge_reorder`). With ``pin_cheap_consumers`` (on by
default) every graph this backend compiles has such consumers moved into their side scope first.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ._torchair import TorchairBackend
from .ge_reorder import pin_cheap_consumers


class GeBackend(TorchairBackend):
    name = "ge"
    data_edges_order_streams = True
    torchair_mode = "max-autotune"
    pin_cheap_consumers = True  # move cheap consumers of side outputs into their side scope before GE sees them

    def compile_backend(self) -> Any:
        import torch_npu  # noqa: F401  (torchair needs it)
        import torchair

        config = torchair.CompilerConfig()
        config.mode = self.torchair_mode
        backend = torchair.get_npu_backend(compiler_config=config)
        return _pinning(backend) if self.pin_cheap_consumers else backend

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        if not consumers:
            return consumers
        if not event.guarded:
            raise ValueError(f"event {event.tag!r} was recorded without the tensors it guards; on the ge path an "
                             f"ordering edge is npu_wait_tensor(consumer, guarded): call ev.record(tensor, ...)")
        return tuple(self.wait_tensor(c, event.guarded) for c in consumers)

    def wait_tensor(self, x: torch.Tensor, deps: Sequence[torch.Tensor]) -> torch.Tensor:
        from torchair.scope import npu_wait_tensor

        for d in deps:
            x = npu_wait_tensor(x, d)
        return x


def _pinning(backend: Any) -> Any:
    """``backend`` applied to each graph after `pin_cheap_consumers`."""
    def compile_pinned(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        pin_cheap_consumers(gm)
        return backend(gm, example_inputs)
    return compile_pinned
