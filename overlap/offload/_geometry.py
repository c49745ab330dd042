"""What an `OffloadCache` holds, and the checks that refuse a request before any copy is issued."""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Sequence, Tuple, Union

import torch

from .. import backends
from ._stores import STORES, human_bytes, store_bytes

Shape = Union[int, Sequence[int]]


class OffloadError(ValueError):
    """An offload request that cannot be served; raised before any copy is issued."""


def as_int(what: str, val: object) -> int:
    """``val`` as an integer (an integral float is accepted); `OffloadError` for anything else."""
    if isinstance(val, float) and val.is_integer():
        return int(val)
    try:
        return operator.index(val)  # type: ignore[arg-type]
    except TypeError:
        raise OffloadError(f"{what} must be an integer, got {val!r}") from None


def _shape(s: Shape, what: str) -> Tuple[int, ...]:
    try:
        out = (operator.index(s),)  # type: ignore[arg-type]
    except TypeError:
        try:
            out = tuple(as_int(what, d) for d in s)  # type: ignore[union-attr]
        except TypeError:
            raise OffloadError(f"{what} must be an integer or a sequence of integers, got {s!r}") from None
    if not out or any(d < 1 for d in out):
        raise OffloadError(f"{what} {out} must have positive sizes")
    return out


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Layers, tokens per layer and per offload, the per-token K and V shapes, dtype and device."""

    n_layers: int
    max_tokens: int
    chunk_tokens: int
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def check_layer(self, layer: int) -> int:
        """``layer`` as an int, within the cache."""
        layer = as_int("layer", layer)
        if not 0 <= layer < self.n_layers:
            raise OffloadError(f"layer {layer} out of range for a cache of {self.n_layers} layers")
        return layer

    def check_range(self, layer: int, start: int, end: int) -> None:
        """Tokens ``[start, end)`` of ``layer`` fit the store."""
        if start < 0 or end > self.max_tokens or start > end:
            raise OffloadError(f"layer {layer}: tokens [{start}, {end}) do not fit a host store of max_tokens="
                               f"{self.max_tokens}")

    def check_chunk(self, layer: int, tokens: int) -> int:
        """``tokens`` fit one device slot (`OffloadCache.acquire`); returns them as an int."""
        tokens = as_int("tokens", tokens)
        if not 1 <= tokens <= self.chunk_tokens:
            raise OffloadError(f"layer {layer}: {tokens} tokens requested, the device slots hold chunk_tokens="
                               f"{self.chunk_tokens}")
        return tokens

    def check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Keys and values one `OffloadCache.offload` can carry for ``layer``; returns their token count."""
        self.check_layer(layer)
        for what, t, shape in (("keys", k, self.k_shape), ("values", v, self.v_shape)):
            if not isinstance(t, torch.Tensor):
                raise OffloadError(f"{what} must be a tensor, got {type(t).__name__}")
            if t.device != self.device:
                raise OffloadError(f"{what} of layer {layer} are on {t.device}, the cache works on {self.device}")
            if t.dtype != self.dtype:
                raise OffloadError(f"{what} of layer {layer} are {t.dtype}, the cache holds {self.dtype}")
            if t.dim() != 1 + len(shape) or tuple(t.shape[1:]) != shape:
                raise OffloadError(f"{what} of layer {layer} have shape {tuple(t.shape)}, expected "
                                   f"(tokens, {', '.join(map(str, shape))})")
        n = k.shape[0]
        if v.shape[0] != n:
            raise OffloadError(f"layer {layer}: {n} key tokens but {v.shape[0]} value tokens")
        if n > self.chunk_tokens:
            raise OffloadError(f"layer {layer}: {n} tokens in one offload, the device slots hold chunk_tokens="
                               f"{self.chunk_tokens}")
        return n

    def check_capacity(self, tokens: int, have_bytes: int) -> None:
        """A prefill of ``tokens`` tokens per layer fits a store of ``have_bytes`` bytes."""
        tokens = as_int("tokens", tokens)
        if tokens > self.max_tokens:
            need = store_bytes(self.n_layers, tokens, self.k_shape, self.v_shape, self.dtype)
            raise OffloadError(f"host store too small: {tokens} tokens per layer requested, it holds max_tokens="
                               f"{self.max_tokens} ({human_bytes(have_bytes)}; {human_bytes(need)} needed)")


def check_held(layer: int, start: int, end: int, held: int) -> None:
    """Tokens ``[start, end)`` of ``layer`` lie within the ``held`` tokens the store has of it."""
    if not 0 <= start < end <= held:
        raise OffloadError(f"layer {layer}: tokens [{start}, {end}) requested, the store holds {held} tokens of it")


def check_path(asynchronous: bool) -> None:
    """Refuse the copy stream inside a compiled graph."""
    backend = backends.current()
    if asynchronous and backend.is_graph:
        raise OffloadError(
            f"KV offload is not available on the {backend.name!r} path: a copy into host memory on a separate "
            f"copy stream cannot be expressed inside a compiled graph. Run the offload on the eager "
            f"path (npu/cuda), or pass enabled=False for plain synchronous copies outside the graph")


def check_args(n_layers: int, max_tokens: int, ring: int, chunk_tokens: Optional[int], prefix_tokens: int,
               store: str, dtype: torch.dtype) -> Tuple[int, int, int, int, int]:
    """The constructor's counts, store and dtype, in the order they are reported.

    Returns ``(n_layers, max_tokens, ring, chunk_tokens, prefix_tokens)`` as ints.
    """
    counts = []
    for what, val in (("n_layers", n_layers), ("max_tokens", max_tokens), ("ring", ring)):
        counts.append(as_int(what, val))
        if counts[-1] < 1:
            raise OffloadError(f"{what} must be >= 1, got {val}")
    n_layers, max_tokens, ring = counts
    chunk_tokens = max_tokens if chunk_tokens is None else as_int("chunk_tokens", chunk_tokens)
    if not 1 <= chunk_tokens <= max_tokens:
        raise OffloadError(f"chunk_tokens={chunk_tokens} must lie in [1, max_tokens={max_tokens}]")
    prefix_tokens = as_int("prefix_tokens", prefix_tokens)
    if not 0 <= prefix_tokens <= max_tokens:
        raise OffloadError(f"prefix_tokens={prefix_tokens} must lie in [0, max_tokens={max_tokens}]")
    if not isinstance(store, str) or store not in STORES:
        raise OffloadError(f"unknown store {store!r}; expected one of {', '.join(STORES)}")
    if not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype == torch.int8)):
        raise OffloadError(f"dtype must be a floating point torch.dtype (or int8), got {dtype!r}")
    return n_layers, max_tokens, ring, chunk_tokens, prefix_tokens


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` with the index tensors on it report (``cuda`` -> ``cuda:0``, ``cpu:0`` -> ``cpu``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise OffloadError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "meta":
        raise OffloadError("device meta holds no data: the cache cannot copy keys and values to or from it")
    try:
        return torch.empty(0, device=dev).device
    except (RuntimeError, AssertionError) as e:
        raise OffloadError(f"device {dev} is not available: {str(e).splitlines()[0] if str(e) else e!r}") from None


def geometry(n_layers: int, max_tokens: int, chunk_tokens: int, kv_shape: Shape, v_shape: Optional[Shape],
             dtype: torch.dtype, device: torch.device) -> Geometry:
    """The geometry of already checked counts; the shapes are checked here."""
    k_shape = _shape(kv_shape, "kv_shape")
    return Geometry(n_layers, max_tokens, chunk_tokens, k_shape,
                    k_shape if v_shape is None else _shape(v_shape, "v_shape"), dtype, device)
