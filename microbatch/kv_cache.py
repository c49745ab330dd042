"""A decode KV cache on the device: per layer, the keys and values of every active request.

Room for each request's prompt and new tokens is allocated once, contiguous per request: a request
takes a slot (`KVCache.admit`) and keeps it until it is done (`KVCache.release`), which frees the
room for the next one. A step first says where its rows go (`rows`: a prefill's prompt, or one
row per active request in decode), once for all layers; each layer writes its keys and values
there (`write`) and attention reads every active request's history at once (`attend`: one masked
attention over the slots, no loop over requests); the rows are counted once every layer has
written them (`advance`).

The lengths live on the host, so placing the rows, masking and checking the room never read the
device: no host sync in a decode step.

A graph captured once for a number of rows (`launch.engine.graph_decoder`) needs a step whose shapes do not change
from step to step: `static_rows` pads a decode step's rows to a fixed count and describes them with tensors
only (`StaticRows`), and `StaticKVStep` attends over every slot's whole ``max_len`` (or its first ``length``
rows: a graph per length) with a mask built on the device from each row's length. A padding row writes
nothing new: it points at row 0 of a slot, which no decode step writes (every request holds its prompt), and
writes back what is there.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.nn.functional as F


_T = TypeVar("_T")
_STATIC_MASK = "kv_cache.static_mask"  # `StaticKVStep.once`'s key of the step's attention mask


def _once(memo: Dict[Hashable, Any], key: Hashable, make: Callable[[], _T]) -> _T:
    if key not in memo:
        memo[key] = make()
    return memo[key]


class KVCacheError(ValueError):
    """A request that does not fit the cache, or a slot that is not in use."""


class KVCache:
    """``n_layers`` x ``max_requests`` slots of ``max_len`` rows of one token's keys (``k_shape``, e.g.
    ``(heads, head_dim)``) and values (``v_shape``, default ``k_shape``): whatever the model's attention
    caches (DeepSeek-V3's compressed latent and rotary key are ``(1, kv_lora_rank)`` and ``(1, rope_dim)``)."""

    def __init__(self, n_layers: int, max_requests: int, max_len: int, k_shape: Sequence[int],
                 v_shape: Optional[Sequence[int]] = None, *, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        n_layers, max_requests, max_len = (_count(name, value, 1) for name, value in (
            ("n_layers", n_layers), ("max_requests", max_requests), ("max_len", max_len)))
        k_shape = _shape("k_shape", k_shape)
        v_shape = k_shape if v_shape is None else _shape("v_shape", v_shape)
        _check_dtype(dtype)
        self.k = self._allocate((n_layers, max_requests, max_len) + k_shape, dtype, device)
        self.v = self._allocate((n_layers, max_requests, max_len) + v_shape, dtype, device)
        self.device = self.k.device  # where attention runs: the rows' indexes and masks live there
        self.max_len = max_len
        self.lengths = [0] * max_requests  # rows held per slot (host), counted by `advance`
        self._free = list(range(max_requests))
        self._used: set = set()

    def _allocate(self, shape: Tuple[int, ...], dtype: torch.dtype, device: Optional[torch.device]) -> torch.Tensor:
        """The zeroed store of keys or values (a subclass keeps it elsewhere: `microbatch.kv_offload`)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    # ---- slots -------------------------------------------------------------------------------
    def admit(self, n: int = 1) -> List[int]:
        """``n`` free slots for new requests (empty); `KVCacheError` if fewer are free."""
        n = _count("n", n, 0)
        if n > len(self._free):
            raise KVCacheError(f"{n} requests do not fit: {len(self._free)} of {len(self.lengths)} slots are free")
        slots, self._free = self._free[:n], self._free[n:]
        for s in slots:
            self._used.add(s)
            self.lengths[s] = 0
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Free the slots of finished requests (their rows are never read again)."""
        for s in self._check(slots):
            self._used.discard(s)
            self._free.append(s)

    @property
    def active(self) -> List[int]:
        """The slots in use, in order."""
        return sorted(self._used)

    def _check(self, slots: Sequence[int], adding: Sequence[int] = ()) -> List[int]:
        """``slots`` as integers, each a slot in use named once (a slot given twice would be freed twice, then
        handed to two requests), with room for ``adding`` more rows each; `KVCacheError` naming the first that
        is not."""
        slots = _slots(slots)
        for s in slots:
            if s not in self._used:
                raise KVCacheError(f"slot {s} is not in use (admit a request first)")
        if len(set(slots)) != len(slots):
            twice = next(s for s in slots if slots.count(s) > 1)
            raise KVCacheError(f"slot {twice} is named twice in slots {slots}: each slot at most once")
        for s, n in zip(slots, adding):
            if self.lengths[s] + n > self.max_len:
                raise KVCacheError(f"slot {s} holds {self.lengths[s]} rows; {n} more exceed its room of "
                                   f"{self.max_len} (prompt + new tokens)")
        return slots

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.long, device=self.device)

    # ---- writing and reading ----------------------------------------------------------------
    def rows(self, slots: Sequence[int], seq_lens: Optional[Sequence[int]] = None) -> "KVRows":
        """Where the next ``seq_lens`` rows of each slot go (one each by default: a decode step), checked
        against the room; computed once per step and used by every layer (`write`, `attend`)."""
        slots = _slots(slots)
        seq_lens = [1] * len(slots) if seq_lens is None else [_count(f"seq_lens[{i}]", n, 0)
                                                              for i, n in enumerate(seq_lens)]
        if len(slots) != len(seq_lens):
            raise KVCacheError(f"{len(slots)} slots but {len(seq_lens)} lengths")
        slots = self._check(slots, seq_lens)
        dev = self.device
        index, counts = self._index(slots), torch.tensor(seq_lens, dtype=torch.long, device=dev)
        held = torch.tensor([self.lengths[s] for s in slots], dtype=torch.long, device=dev)
        total = sum(seq_lens)  # known here: the repeats below need no device read to size their output
        if all(n == 1 for n in seq_lens):  # a decode step: one row per slot
            where = torch.stack([index, held], dim=1)
        else:
            first = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)  # its request's
            position = (torch.repeat_interleave(held, counts, output_size=total) + torch.arange(total, device=dev)
                        - first)
            where = torch.stack([torch.repeat_interleave(index, counts, output_size=total), position], dim=1)
        seen = [self.lengths[s] + n for s, n in zip(slots, seq_lens)]
        longest = max(seen, default=0)
        mask = torch.arange(longest, device=dev)[None, :] < (held + counts)[:, None]
        return KVRows(list(slots), seq_lens, where, index, mask, longest)

    def write(self, layer: int, rows: "KVRows", k: torch.Tensor, v: torch.Tensor) -> None:
        """The keys ``[sum(rows.seq_lens), *k_shape]`` and values (``v_shape``), packed slot after slot, into
        ``rows``."""
        self._check_kv(layer, rows, k, v)
        self.k[layer, rows.where[:, 0], rows.where[:, 1]] = k.to(self.k.dtype)
        self.v[layer, rows.where[:, 0], rows.where[:, 1]] = v.to(self.v.dtype)

    def _check_layer(self, layer: int) -> None:
        """`KVCacheError` unless ``layer`` is an index of one of the cache's layers."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.k.shape[0]:
            raise KVCacheError(f"layer must be an integer in [0, {self.k.shape[0]}) (the cache's layers), "
                               f"got {layer!r}")

    def _check_kv(self, layer: int, rows: "KVRows", k: torch.Tensor, v: torch.Tensor) -> int:
        """The number of ``rows``; `KVCacheError` unless ``layer`` is the cache's and ``k`` and ``v`` hold one key and
        value for each, of the cache's dtype (a cast would hide a model that computes in another dtype)."""
        self._check_layer(layer)
        for name, x in (("keys", k), ("values", v)):
            if x.dtype != self.k.dtype:
                raise KVCacheError(f"{name} of dtype {x.dtype} do not go into a cache of {self.k.dtype}: make the "
                                   f"cache of the model's dtype")
        n = rows.where.shape[0]
        if k.shape[0] != n or v.shape[0] != n or k.shape[1:] != self.k.shape[3:] or v.shape[1:] != self.v.shape[3:]:
            raise KVCacheError(f"{rows.where.shape[0]} rows, keys {tuple(k.shape)} and values {tuple(v.shape)} do "
                               f"not go together")
        return n

    def advance(self, rows: "KVRows") -> None:
        """Count ``rows`` once every layer has written them."""
        self._check(rows.slots, rows.seq_lens)
        for s, n in zip(rows.slots, rows.seq_lens):
            self.lengths[s] += n

    def history(self, layer: int, rows: "KVRows") -> Tuple[torch.Tensor, torch.Tensor]:
        """Every slot of ``rows``'s keys ``[slots, rows.longest, *k_shape]`` and values, those of ``rows``
        included (rows past a slot's length are padding: ``rows.mask`` says which are held). A copy of the
        slots' first ``rows.longest`` rows, never of the whole ``max_len`` (attention over a view of the cache
        is slower on CPU than the copy and attention over it)."""
        return (self.k[layer, :, :rows.longest].index_select(0, rows.index),
                self.v[layer, :, :rows.longest].index_select(0, rows.index))

    def attend(self, layer: int, rows: "KVRows", q: torch.Tensor) -> torch.Tensor:
        """Decode attention: ``q [len(rows.slots), heads, head_dim]``, one query per request, over each slot's
        rows including those of ``rows`` (written, not yet counted); one masked attention over all the slots."""
        self._check_layer(layer)
        if tuple(q.shape) != (len(rows.slots),) + tuple(self.k.shape[3:]):
            raise KVCacheError(f"queries {tuple(q.shape)} do not go with {len(rows.slots)} slots of keys "
                               f"{tuple(self.k.shape[3:])}: one query per slot, as many heads as the keys")
        if not rows.slots:
            return q
        keys, values = (x.transpose(1, 2) for x in self.history(layer, rows))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(2).to(keys.dtype), keys, values,
                                             attn_mask=rows.mask[:, None, None, :])
        return out.squeeze(2).to(q.dtype)

    # ---- a decode step of static shapes (graph capture per bucket) ----------------------------
    def static_rows(self, slots: Sequence[Optional[int]]) -> "StaticRows":
        """A decode step's rows, one per entry of ``slots``: a slot in use gets its next row, None a padding
        row (it changes nothing: `StaticRows`); checked against the room. Each slot appears at most once and
        holds at least one row (its prompt: a decode step follows the prefill)."""
        if isinstance(slots, (str, bytes, torch.Tensor)) or not isinstance(slots, Sequence):
            _slots(slots)  # refused as a slot list is
        real = self._check([s for s in slots if s is not None], [1] * len(slots))
        empty = [s for s in real if self.lengths[s] == 0]
        if empty:
            raise KVCacheError(f"slot {empty[0]} holds no row yet: a decode step follows the prefill")
        pad = real[0] if real else 0  # row 0 of any slot: no decode step writes it
        dev = self.device
        return StaticRows(index=torch.tensor([pad if s is None else s for s in slots], dtype=torch.long, device=dev),
                          held=torch.tensor([0 if s is None else self.lengths[s] for s in slots], dtype=torch.long,
                                            device=dev),
                          real=torch.tensor([s is not None for s in slots], dtype=torch.bool, device=dev),
                          slots=tuple(real))

    def write_static(self, layer: int, rows: "StaticRows", k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s keys ``[rows, *k_shape]`` and values of a static step into their rows; a padding
        row writes back what its row holds (the real rows never share it: the step's shapes stay fixed)."""
        self._check_layer(layer)
        n = rows.index.shape[0]
        if k.shape[0] != n or v.shape[0] != n or k.shape[1:] != self.k.shape[3:] or v.shape[1:] != self.v.shape[3:]:
            raise KVCacheError(f"{n} rows, keys {tuple(k.shape)} and values {tuple(v.shape)} do not go together")
        for store, new in ((self.k, k), (self.v, v)):
            old = store[layer, rows.index, rows.held]
            keep = rows.real.view((n,) + (1,) * (new.dim() - 1))
            store[layer, rows.index, rows.held] = torch.where(keep, new.to(store.dtype), old)

    def static_mask(self, rows: "StaticRows", length: Optional[int] = None) -> torch.Tensor:
        """The rows of its slot each row of a static step attends to, ``[rows, length]`` bool (default ``max_len``):
        ``0..held``, its new one included (a padding row: row 0). Built on the device; the same for every layer
        of the step."""
        n = self.max_len if length is None else length
        return torch.arange(n, device=rows.held.device)[None, :] <= rows.held[:, None]

    def attend_static(self, layer: int, rows: "StaticRows", q: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      length: Optional[int] = None) -> torch.Tensor:
        """`attend` of a static step: each row's query over its slot's first ``length`` rows (default: the whole
        ``max_len``; every row's ``held`` must lie below it), masked on the device to the rows it holds and its
        new one (``mask``: `static_mask`, built here when not given); `KVCacheError` naming what does not fit."""
        self._check_layer(layer)
        n = self.max_len if length is None else _count("length", length, 1)
        self._check_static(rows, q, mask, n)
        keys = self.k[layer, :, :n].index_select(0, rows.index).transpose(1, 2)  # [B, H, length, D]
        values = self.v[layer, :, :n].index_select(0, rows.index).transpose(1, 2)
        mask = self.static_mask(rows, n) if mask is None else mask
        out = F.scaled_dot_product_attention(q.unsqueeze(2).to(keys.dtype), keys, values,
                                             attn_mask=mask[:, None, None, :])
        return out.squeeze(2).to(q.dtype)

    def _check_static(self, rows: "StaticRows", q: torch.Tensor, mask: Optional[torch.Tensor], length: int) -> None:
        """`KVCacheError` naming the argument where `attend_static`'s ``length``, ``q`` or ``mask`` do not go with
        the cache and ``rows`` (shapes only: nothing read on the device)."""
        if length > self.max_len:
            raise KVCacheError(f"length {length} is more than the cache's room (max_len {self.max_len})")
        want = (rows.index.shape[0],) + tuple(self.k.shape[3:])
        if tuple(q.shape) != want:
            raise KVCacheError(f"queries {tuple(q.shape)} do not go with {want[0]} rows of keys "
                               f"{tuple(self.k.shape[3:])}: one query per row, as many heads as the keys")
        if mask is not None and tuple(mask.shape) != (want[0], length):
            raise KVCacheError(f"mask {tuple(mask.shape)} does not go with {want[0]} rows over length {length}: "
                               f"[rows, length] (static_mask)")


def _count(name: str, value: Any, least: int) -> int:
    """``value``, an integer (not a bool) of at least ``least``; `KVCacheError` naming ``name`` otherwise."""
    try:
        count = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        count = None
    if count is None or count < least:
        raise KVCacheError(f"{name} must be an integer of at least {least}, got {value!r}")
    return count


def _slots(slots: Any) -> List[int]:
    """``slots``, a sequence of slot numbers, as a list of ints; `KVCacheError` naming what is not."""
    if isinstance(slots, (str, bytes, torch.Tensor)) or not isinstance(slots, Sequence):
        raise KVCacheError(f"slots must be a sequence of slot numbers (from admit), got {slots!r}")
    return [_slot(s) for s in slots]


def _slot(value: Any) -> int:
    """``value``, a slot number (an integer, not a bool); `KVCacheError` otherwise."""
    if isinstance(value, bool):
        raise KVCacheError(f"a slot is an integer from admit, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KVCacheError(f"a slot is an integer from admit, got {value!r}") from None


def _shape(name: str, shape: Any) -> Tuple[int, ...]:
    """``shape``, a non-empty sequence of positive integers (one token's keys or values), as a tuple."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, torch.Size)) or len(shape) == 0:
        raise KVCacheError(f"{name} must be a non-empty sequence of positive integers (one token's), got {shape!r}")
    return tuple(_count(f"{name}[{i}]", n, 1) for i, n in enumerate(shape))


def _check_dtype(dtype: Any) -> None:
    """`KVCacheError` unless ``dtype`` is a floating point torch dtype (keys and values are)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise KVCacheError(f"dtype must be a floating point torch.dtype, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class KVRows:
    """Rows about to be written to slots (`KVCache.rows`): their ``(slot, position)`` pairs ``where``, the slots
    as a device index, and the mask of every slot's rows, these included, for `KVCache.attend`."""

    slots: List[int]
    seq_lens: List[int]
    where: torch.Tensor  # [rows, 2]
    index: torch.Tensor  # [slots]
    mask: torch.Tensor  # [slots, longest] bool
    longest: int


@dataclasses.dataclass(frozen=True)
class KVStep:
    """A step's view of the cache for attention (the ``KV_STEP`` value): where its rows go, and the cache."""

    cache: KVCache
    rows: KVRows
    made: Dict[Hashable, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # `once`'s

    @property
    def positions(self) -> torch.Tensor:
        """Each row's position in its request (rotary embeddings): ``[rows]``."""
        return self.rows.where[:, 1]

    def once(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """``make()``, made by the first layer of this step that asks for ``key`` and given to the others: what every
        layer computes alike from the step (rotary tables, a mask), once a step instead of once a layer."""
        return _once(self.made, key, make)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s keys and values of this step's rows and attend to every slot's history."""
        self.cache.write(layer, self.rows, k, v)
        return self.cache.attend(layer, self.rows, q)


@dataclasses.dataclass(frozen=True)
class StaticRows:
    """A decode step's rows at a fixed count (`KVCache.static_rows`), described by device tensors only: row i
    writes at ``(index[i], held[i])`` and attends to that slot's rows ``0..held[i]``; a padding row (``real``
    False) points at row 0 of a slot and writes back what is there. ``slots``: the real rows' slots, on the
    host (for `KVCache.advance`; a captured graph never reads it)."""

    index: torch.Tensor  # [rows] int64
    held: torch.Tensor  # [rows] int64: rows the slot holds before this step, the position of its new row
    real: torch.Tensor  # [rows] bool
    slots: Tuple[int, ...] = ()

    @property
    def seq_lens(self) -> List[int]:
        """One row per real slot (what `KVCache.advance` counts)."""
        return [1] * len(self.slots)

    def part(self, start: int, stop: int) -> "StaticRows":
        """Rows ``start:stop`` (a micro-batch's), tensors only."""
        return StaticRows(self.index[start:stop], self.held[start:stop], self.real[start:stop])


@dataclasses.dataclass(frozen=True)
class StaticKVStep:
    """A static decode step's view of the cache for attention (the ``KV_STEP`` value of a graph-captured step):
    `KVStep`'s ``positions`` and ``attend``, over every slot's first ``length`` rows (default its whole
    ``max_len``; a graph per length keeps the shapes static)."""

    cache: KVCache
    rows: StaticRows
    length: Optional[int] = None
    made: Dict[Hashable, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # `once`'s

    def __post_init__(self) -> None:
        if self.length is not None and not 1 <= self.length <= self.cache.max_len:
            raise KVCacheError(f"a static step attends over 1 to {self.cache.max_len} rows of each slot (its room), "
                               f"got length {self.length}")

    @property
    def positions(self) -> torch.Tensor:
        """Each row's position in its request (rotary embeddings): ``[rows]``."""
        return self.rows.held

    def once(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """`KVStep.once`: in a captured step, made in the graph by the first layer that asks."""
        return _once(self.made, key, make)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s keys and values of this step's rows and attend to every slot's history (the mask
        built once a step, by the first layer: in a captured graph, two kernels fewer a layer)."""
        self.cache.write_static(layer, self.rows, k, v)
        mask = self.once(_STATIC_MASK, lambda: self.cache.static_mask(self.rows, self.length))
        return self.cache.attend_static(layer, self.rows, q, mask, self.length)


__all__ = ["KVCache", "KVCacheError", "KVRows", "KVStep", "StaticKVStep", "StaticRows"]
