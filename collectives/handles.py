"""One interface for every dispatch / combine family, so that portable code never asks which one it holds.

Three families move tokens to their experts and back: `collectives.dispatch` (uneven all-to-all,
`DispatchHandle`, `ExpertBatch`), `collectives.capacity` (static shapes, `CapacityDispatchHandle`,
`CapacityBatch`) and `collectives.mc2` (torch_npu's fused operators, `MC2DispatchHandle`,
`MC2Batch`). Each handle and batch satisfies the protocols below, so this runs unchanged on every
one of them::

    h = ep_dispatch(...)                          # or dispatch(...), capacity_dispatch(...), mc2_dispatch(...)
    h.wait()                                      # the current stream waits for the exchange
    batch = h.expand()                            # rows grouped by local expert
    y = local_experts(batch.x, batch.group_list)  # one output row per row of batch.x
    out = h.combine(y, batch).wait()              # [tokens, hidden]

Rows of ``batch.x`` past the sum of the counts are padding (MC2 and capacity batches have a
fixed number of rows): their outputs are never read, and a group-list kernel leaves them zero.

The layer does not read these handles itself: each exchange (`collectives.exchange.Exchange`, one class per
family) takes its own back in its ``run_experts`` and ``combine``.

``isinstance`` with these ``runtime_checkable`` protocols checks names only; the tests of each
family (``tests/test_dispatch.py``, ``test_capacity.py``, ``test_mc2.py``) check every member of
each protocol on its handles and batches, with a signature that takes the protocol's calls.
"""
from __future__ import annotations

from typing import List, Protocol, runtime_checkable

import torch


@runtime_checkable
class EPBatch(Protocol):
    """Received rows grouped by local expert: ``counts[0]`` rows of expert 0 first, then expert 1's, ...

    ``x``: ``[rows, hidden]``; ``counts``: rows per local expert as host ints (read back from the
    device where only the device has them); ``group_list``: the same counts as an int64 tensor
    ``[E_local]`` on ``x``'s device, nothing read on the host (the form grouped matmuls take).
    """

    @property
    def x(self) -> torch.Tensor: ...

    @property
    def counts(self) -> List[int]: ...

    @property
    def group_list(self) -> torch.Tensor: ...


@runtime_checkable
class EPCombineHandle(Protocol):
    """A combine in flight: ``wait()`` orders the current stream after it and returns the tokens ``[T, H]``."""

    def wait(self) -> torch.Tensor: ...


@runtime_checkable
class EPDispatchHandle(Protocol):
    """A dispatch in flight.

    ``wait()`` orders the current stream after the exchange (returns the handle); ``expand()`` gives
    the `EPBatch` for the local experts (after ``wait``); ``combine(expert_out, batch)`` sends one
    output row per row of ``batch.x`` back and sums each token's weighted rows (``batch``: the one
    this handle's ``expand`` returned; ``async_finish``: return before the exchange completes, and
    ``wait`` on the result).
    """

    def wait(self) -> "EPDispatchHandle": ...

    def expand(self) -> EPBatch: ...

    def combine(self, expert_out: torch.Tensor, batch: EPBatch, *, async_finish: bool = False) -> EPCombineHandle: ...


__all__ = ["EPBatch", "EPCombineHandle", "EPDispatchHandle"]
