"""Where offloaded keys and values live: host memory, a memory-mapped file, or the device itself.

A store holds K and V of every layer as ``[n_layers, max_tokens, *shape]``. Its size is checked
against the memory or disk that can hold it before anything is allocated, so a prefill that
would not fit fails at once with the numbers, not halfway with an allocator error or a SIGBUS.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from typing import Optional, Tuple

import torch

STORES = ("memory", "mmap", "device")


class StoreError(ValueError):
    """The requested store cannot hold the keys and values asked for."""


@dataclasses.dataclass
class KVStore:
    """K and V of every layer, ``[n_layers, max_tokens, *shape]`` each, and the file behind them."""

    kind: str
    k: torch.Tensor
    v: torch.Tensor
    file: Optional[str] = None
    owns_file: bool = False
    existed: bool = False  # an mmap file opened with its contents kept (resuming an offloaded prefix)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def rows(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``[start, end)`` of ``layer`` (views into the store)."""
        return self.k[layer, start:end], self.v[layer, start:end]

    def close(self) -> None:
        self.k = self.v = torch.empty(0)
        if self.owns_file and self.file and os.path.exists(self.file):
            os.remove(self.file)


def store_bytes(n_layers: int, max_tokens: int, k_shape: Tuple[int, ...], v_shape: Tuple[int, ...],
                dtype: torch.dtype) -> int:
    """Bytes a store of this geometry needs."""
    per_token = math.prod(k_shape) + math.prod(v_shape)
    return n_layers * max_tokens * per_token * torch.empty((), dtype=dtype).element_size()


def _available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _file_path(file: Optional[str], name: str) -> Tuple[str, bool]:
    """The store file: a temporary one (removed on close), one inside a folder (per rank), or ``file``."""
    if file is None:
        fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".kv")
        os.close(fd)
        os.remove(tmp)  # created again, at its full size, by from_file
        return tmp, True
    if os.path.isdir(file):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return os.path.join(file, f"{name}-rank{rank}.kv"), False
    return file, False


def open_store(kind: str, n_layers: int, max_tokens: int, k_shape: Tuple[int, ...], v_shape: Tuple[int, ...],
               dtype: torch.dtype, device: torch.device, file: Optional[str] = None, name: str = "kv",
               pin: bool = False) -> KVStore:
    """Allocate (or open) a store; raises `StoreError` naming the shortfall before allocating."""
    if kind not in STORES:
        raise StoreError(f"unknown KV store {kind!r}; expected one of {', '.join(STORES)}")
    need = store_bytes(n_layers, max_tokens, k_shape, v_shape, dtype)
    k_numel = n_layers * max_tokens * math.prod(k_shape)
    if kind == "device":
        flat = torch.empty(need // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
        return _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
    if kind == "memory":
        avail = _available_memory()
        if avail is not None and need > avail:
            raise StoreError(f"host store too small: {n_layers} layers x {max_tokens} tokens of keys and values "
                             f"need {need / 2**30:.2f} GiB, only {avail / 2**30:.2f} GiB of host memory is available; "
                             f"lower max_tokens or use store='mmap'")
        flat = torch.empty(need // torch.empty((), dtype=dtype).element_size(), dtype=dtype, pin_memory=pin)
        return _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
    target, owns = _file_path(file, name)
    existed = os.path.exists(target)
    if existed:
        have = os.path.getsize(target)
        if have != need:
            raise StoreError(f"host store file {target} holds {have} bytes but {n_layers} layers x {max_tokens} "
                             f"tokens of keys and values need {need}; remove it or open it with the geometry it was "
                             f"written with")
    else:
        folder = os.path.dirname(os.path.abspath(target))
        free = shutil.disk_usage(folder).free
        if need > free:
            raise StoreError(f"host store too small: {n_layers} layers x {max_tokens} tokens of keys and values need "
                             f"{need / 2**30:.2f} GiB, only {free / 2**30:.2f} GiB free in {folder}")
    flat = torch.from_file(target, shared=True, size=need // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    store = _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
    store.file, store.owns_file, store.existed = target, owns, existed
    return store


def _split(kind: str, flat: torch.Tensor, k_numel: int, n_layers: int, max_tokens: int,
           k_shape: Tuple[int, ...], v_shape: Tuple[int, ...]) -> KVStore:
    k = flat[:k_numel].view(n_layers, max_tokens, *k_shape)
    v = flat[k_numel:].view(n_layers, max_tokens, *v_shape)
    return KVStore(kind, k, v)
