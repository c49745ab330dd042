"""Where offloaded keys and values live: host memory, a memory-mapped file, or the device itself.

A store holds K and V of every layer as ``[n_layers, max_tokens, *shape]``. Its size is checked
against the memory or disk that can hold it before anything is allocated, and an mmap file's
blocks are reserved (``posix_fallocate``) before it is mapped, so a prefill that would not fit
fails at once with the numbers, not halfway with an allocator error or a SIGBUS.

A temporary mmap file (no ``file``) is unlinked as soon as it is mapped: the mapping stays valid
and its space is freed when it is unmapped, so nothing is left behind on Ctrl-C, an exception
or SIGKILL. A named file is locked (``flock``) while a store has it open, so a second store on it
(another process, or ranks sharing a folder without torch.distributed) is refused.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import shutil
import stat
import tempfile
import weakref
from typing import Any, Optional, Tuple

import torch

try:
    import fcntl
except ImportError:  # not on Windows: no lock
    fcntl = None  # type: ignore[assignment]

STORES = ("memory", "mmap", "device")
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class StoreError(ValueError):
    """The requested store cannot hold the keys and values asked for."""


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units with three significant digits, never rounded to zero: 512 B, 12.0 KiB, 1.20 GiB."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        digits = 2
        while digits and round(value, digits) >= 10 ** (3 - digits):
            digits -= 1
        if round(value, digits) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.{digits}f} {unit}"


@dataclasses.dataclass
class KVStore:
    """K and V of every layer, ``[n_layers, max_tokens, *shape]`` each, and the file behind them."""

    kind: str
    k: torch.Tensor
    v: torch.Tensor
    file: Optional[str] = None  # None for memory, device and (unlinked) temporary mmap stores
    owns_file: bool = False  # a temporary file that could not be unlinked early: removed on close
    existed: bool = False  # an mmap file opened with its contents kept (resuming an offloaded prefix)
    lock: Optional[Any] = None  # closes the fd holding the file's lock: on close, or when the store is dropped

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def rows(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``[start, end)`` of ``layer`` (views into the store)."""
        return self.k[layer, start:end], self.v[layer, start:end]

    def close(self) -> None:
        """Drop the tensors, release the file's lock and remove an owned file (twice is fine)."""
        self.k = self.v = torch.empty(0)
        if self.lock is not None:
            self.lock()
        if self.owns_file and self.file:
            self.owns_file = False
            _remove(self.file)


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


def _remove(target: str) -> None:
    try:
        os.remove(target)
    except FileNotFoundError:
        pass


def _free(folder: str) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _file_path(file: str, name: str) -> str:
    """The store file: one inside a folder (per rank), or ``file`` itself."""
    if os.path.isdir(file):
        if os.sep in name or (os.altsep and os.altsep in name):
            raise StoreError(f"cache name {name!r} cannot name a file in {file}: it holds a path separator")
        return os.path.join(file, f"{name}-rank{_rank()}.kv")
    return file


def _open_file(target: str, must_exist: bool, what: str) -> Tuple[int, bool]:
    """An fd open for reading and writing on ``target`` and whether this call created it."""
    folder = os.path.dirname(os.path.abspath(target))
    cloexec = getattr(os, "O_CLOEXEC", 0)
    if os.path.isdir(target):  # a folder in the store file's place (in a folder given as file=: its rank's name)
        raise StoreError(f"host store file {target} is not a regular file (a folder)")
    try:
        return os.open(target, os.O_RDWR | cloexec), False
    except FileNotFoundError:
        if must_exist:
            raise StoreError(f"{what} needs an existing mmap file holding that prefix; {target} does not exist") from None
        if not os.path.isdir(folder):
            raise StoreError(f"cannot create the host store file {target}: folder {folder} does not exist") from None
    except OSError as e:
        raise StoreError(f"cannot open the host store file {target} for reading and writing: {e.strerror}") from None
    try:
        return os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | cloexec, 0o600), True
    except FileExistsError:  # created by someone else meanwhile: theirs, not ours
        return _open_file(target, must_exist, what)
    except OSError as e:
        raise StoreError(f"cannot create the host store file {target}: {e.strerror}") from None


def _lock(fd: int, target: str) -> None:
    """Hold ``target`` exclusively while this store is open (released when ``fd`` is closed)."""
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StoreError(f"host store file {target} is in use by another open cache (another process, a rank "
                         f"sharing the folder without torch.distributed initialised, or a cache in this process "
                         f"not closed yet); close it or give each cache its own file or name") from None
    except OSError:  # the filesystem has no locks (some network filesystems): go on unlocked
        pass


def _reserve(fd: int, target: str, need: int, created: bool, geometry: str) -> None:
    """Allocate the file's blocks for real, so that writes through the mapping cannot hit a full disk."""
    fallocate = getattr(os, "posix_fallocate", None)
    try:
        try:
            if fallocate is None:
                raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
            fallocate(fd, 0, need)
        except OSError as e:
            if e.errno not in _NO_FALLOCATE:
                raise
            if created:  # cannot reserve without writing: write zeros (the file is new, nothing is lost)
                _write_zeros(fd, need)
            # an existing file is left as it is: writing would destroy its contents
    except OSError as e:
        folder = os.path.dirname(os.path.abspath(target))
        if created:  # give back what was allocated before the failure, so the free space reads true
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
        if e.errno in _FULL:
            raise StoreError(f"host store too small: {geometry} need {human_bytes(need)} ({need} bytes) in "
                             f"{target}, only {human_bytes(_free(folder))} free in {folder}") from None
        if e.errno == errno.EFBIG:
            raise StoreError(f"host store file {target} cannot grow to {human_bytes(need)} ({need} bytes): file too "
                             f"large for the process's file size limit (ulimit -f) or the filesystem; "
                             f"{human_bytes(_free(folder))} free in {folder}") from None
        raise StoreError(f"cannot reserve {human_bytes(need)} for the host store file {target}: {e.strerror}; "
                         f"{human_bytes(_free(folder))} free in {folder}") from None


def _write_zeros(fd: int, need: int) -> None:
    block = bytes(1 << 20)
    done = 0
    while done < need:
        done += os.pwrite(fd, block[:min(len(block), need - done)], done)


def _map(source: str, target: str, need: int, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.from_file(source, shared=True, size=need // torch.empty((), dtype=dtype).element_size(),
                               dtype=dtype)
    except RuntimeError as e:
        raise StoreError(f"cannot map the host store file {target} ({human_bytes(need)}): {e}") from None


def _check_free(folder: str, need: int, geometry: str) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise StoreError(f"host store too small: {geometry} need {human_bytes(need)} ({need} bytes), only "
                         f"{human_bytes(free)} free in {folder}")


def _temporary(name: str, need: int, dtype: torch.dtype, geometry: str) -> Tuple[torch.Tensor, Optional[str]]:
    """A mapped temporary file, unlinked at once (its name when it could not be unlinked)."""
    if os.sep in name or (os.altsep and os.altsep in name):
        raise StoreError(f"cache name {name!r} cannot name a temporary file: it holds a path separator")
    folder = tempfile.gettempdir()
    _check_free(folder, need, geometry)
    try:
        fd, target = tempfile.mkstemp(prefix=f"{name}-", suffix=".kv")
    except OSError as e:
        raise StoreError(f"cannot create a temporary host store file in {folder}: {e.strerror}") from None
    by_fd = f"/proc/self/fd/{fd}"
    unlinked = False
    try:
        if os.path.exists(by_fd):  # mapped through the fd: the name is gone before the file grows
            os.remove(target)
            unlinked = True
        _reserve(fd, target, need, True, geometry)
        flat = _map(by_fd if unlinked else target, target, need, dtype)
        if not unlinked:
            try:
                os.remove(target)
                unlinked = True
            except OSError:  # a platform that cannot unlink a mapped file: removed on close
                pass
    except BaseException:
        if not unlinked:
            _remove(target)
        raise
    finally:
        os.close(fd)
    return flat, None if unlinked else target


def _named(file: str, name: str, need: int, dtype: torch.dtype, geometry: str,
           prefix_tokens: int) -> Tuple[torch.Tensor, str, bool, int]:
    """A mapped named file, its path, whether it existed and the fd holding its lock."""
    target = _file_path(os.fspath(file), name)
    fd, created = _open_file(target, prefix_tokens > 0, f"prefix_tokens={prefix_tokens}")
    try:
        # what the file is comes first: a device node is refused whoever else has it open
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"host store file {target} is not a regular file")
        _lock(fd, target)
    except BaseException:  # someone else holds it, even if this call created it
        os.close(fd)
        raise
    try:
        st = os.fstat(fd)
        if not created and st.st_size != need:
            raise StoreError(f"host store file {target} holds {human_bytes(st.st_size)} ({st.st_size} bytes) but "
                             f"{geometry} need {human_bytes(need)} ({need} bytes); remove it or open it with the "
                             f"geometry it was written with")
        if created:
            _check_free(os.path.dirname(os.path.abspath(target)), need, geometry)
        _reserve(fd, target, need, created, geometry)
        flat = _map(target, target, need, dtype)
    except BaseException:
        os.close(fd)
        if created:
            _remove(target)
        raise
    return flat, target, not created, fd


def open_store(kind: str, n_layers: int, max_tokens: int, k_shape: Tuple[int, ...], v_shape: Tuple[int, ...],
               dtype: torch.dtype, device: torch.device, file: Optional[str] = None, name: str = "kv",
               pin: bool = False, prefix_tokens: int = 0) -> KVStore:
    """Allocate (or open) a store; raises `StoreError` naming the shortfall before allocating."""
    if kind not in STORES:
        raise StoreError(f"unknown KV store {kind!r}; expected one of {', '.join(STORES)}")
    if prefix_tokens and kind != "mmap":
        raise StoreError(f"prefix_tokens={prefix_tokens} needs an existing mmap file holding that prefix; "
                         f"store={kind!r} starts empty")
    need = store_bytes(n_layers, max_tokens, k_shape, v_shape, dtype)
    numel = need // torch.empty((), dtype=dtype).element_size()
    k_numel = n_layers * max_tokens * math.prod(k_shape)
    geometry = f"{n_layers} layers x {max_tokens} tokens of keys and values"
    if kind in ("device", "memory"):
        if kind == "memory":
            avail = _available_memory()
            if avail is not None and need > avail:
                raise StoreError(f"host store too small: {geometry} need {human_bytes(need)}, only "
                                 f"{human_bytes(avail)} of host memory is available; lower max_tokens or use "
                                 f"store='mmap'")
        try:
            flat = (torch.empty(numel, dtype=dtype, device=device) if kind == "device"
                    else torch.empty(numel, dtype=dtype, pin_memory=pin))
        except (RuntimeError, MemoryError) as e:
            where = f"on {device}" if kind == "device" else "of pinned host memory" if pin else "of host memory"
            raise StoreError(f"cannot allocate the {kind} store: {geometry} need {human_bytes(need)} {where}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
    if file is None:
        if prefix_tokens:
            raise StoreError(f"prefix_tokens={prefix_tokens} needs an existing mmap file holding that prefix; "
                             f"pass its file=")
        flat, leftover = _temporary(name, need, dtype, geometry)
        store = _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
        store.file, store.owns_file = leftover, leftover is not None
        return store
    flat, target, existed, fd = _named(file, name, need, dtype, geometry, prefix_tokens)
    store = _split(kind, flat, k_numel, n_layers, max_tokens, k_shape, v_shape)
    store.file, store.existed = target, existed
    store.lock = weakref.finalize(store, os.close, fd)
    return store


def _split(kind: str, flat: torch.Tensor, k_numel: int, n_layers: int, max_tokens: int,
           k_shape: Tuple[int, ...], v_shape: Tuple[int, ...]) -> KVStore:
    k = flat[:k_numel].view(n_layers, max_tokens, *k_shape)
    v = flat[k_numel:].view(n_layers, max_tokens, *v_shape)
    return KVStore(kind, k, v)
