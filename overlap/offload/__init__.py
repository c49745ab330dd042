"""KV-cache offload on its own stream: one mechanism, a `Ring` of device slots filled from the host and drained to
it on the ``kv_offload`` stream, and its meters (`DeviceBytes`, `PrefetchMeter` -> `PrefetchReport`).

`OffloadCache` (prefill) offloads each layer's keys and values through a ring and prefetches them back through
another; decode's host KV cache (`microbatch.OffloadedKVCache`) prefetches each layer's history through a ring
per micro-batch.
"""
from .cache import OffloadCache, OffloadError
from .meter import CopyTiming, DeviceBytes, PrefetchMeter, PrefetchReport
from .ring import DrainCopy, FillCopy, Ring, issue_copies

__all__ = ["CopyTiming", "DeviceBytes", "DrainCopy", "FillCopy", "OffloadCache", "OffloadError", "PrefetchMeter",
           "PrefetchReport", "Ring", "issue_copies"]
