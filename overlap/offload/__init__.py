"""KV-cache offload on its own stream: `OffloadCache` offloads each layer's keys and values and prefetches them back."""
from .cache import OffloadCache, OffloadError

__all__ = ["OffloadCache", "OffloadError"]
