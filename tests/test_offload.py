"""KV-cache offload: the store equals the keys and values of a run without offload, on every
schedule and 1-2 ranks; prefetch round trips exactly; bad input is refused before any work."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import overlap
from overlap import hooks
from overlap.multirank import run_ranks
from overlap import OffloadCache, OffloadError

pytestmark = pytest.mark.cpu_only

LAYERS, TOKENS, HEADS, DIM, HIDDEN = 3, 24, 2, 8, 16
SCHEDULES = ("serial", "shared", "two_batch")


def _weights(layers=LAYERS, hidden=HIDDEN, heads=HEADS, dim=DIM):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5  # noqa: E731
    return [dict(wk=mk(hidden, heads * dim), wv=mk(hidden, heads * dim), wo=mk(heads * dim, hidden),
                 ws=mk(hidden, hidden)) for _ in range(layers)]


def _attention(h, w, heads=HEADS, dim=DIM):
    """Keys, values and output of a toy attention (causal within the chunk)."""
    k = (h @ w["wk"]).view(-1, heads, dim)
    v = (h @ w["wv"]).view(-1, heads, dim)
    scores = torch.einsum("thd,shd->hts", k, k) / dim ** 0.5
    scores = scores + torch.full_like(scores, float("-inf")).triu(1)
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(h.shape[0], -1)
    return k, v, out


def _prefill(x, weights, schedule, cache=None, group=None):
    """A synthetic layer loop shaped like the three schedules; returns (output, per-layer K, per-layer V).

    serial: one chunk per layer. shared: one chunk, a shared branch on the SHARED stream
    and (multi-rank) an all_reduce on the COMM stream. two_batch: two micro-batches per layer,
    attention of mb1 issued while mb0's keys and values are still being copied.
    """
    chunks = list(x.split([x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])) if schedule == "two_batch" else [x]
    ks, vs = [[] for _ in weights], [[] for _ in weights]
    for layer, w in enumerate(weights):
        for mb, h in enumerate(chunks):
            with overlap.span("attn", layer=layer, mb=mb):
                k, v, a = _attention(h, w)
            if cache is not None:
                cache.offload(layer, k, v)
            ks[layer].append(k)
            vs[layer].append(v)
            with overlap.span("mlp", layer=layer, mb=mb):
                h = torch.tanh(a @ w["wo"]) + h
            if schedule == "shared":
                with overlap.stream(overlap.SHARED_EXPERT):
                    s = torch.relu(h @ w["ws"])
                h = h + s
            if group is not None:
                ev = overlap.event("test_offload.combine")
                with overlap.stream(overlap.EP_COMM):
                    overlap.all_reduce(h, group=group)
                    ev.record(h)
                h = ev.wait(h)
            chunks[mb] = h
    return torch.cat(chunks), [torch.cat(t) for t in ks], [torch.cat(t) for t in vs]


def _cache(**kw):
    args = dict(n_layers=LAYERS, max_tokens=TOKENS, kv_shape=(HEADS, DIM), dtype=torch.float32, device="cpu")
    args.update(kw)
    return OffloadCache(**args)


def _schedules_match(ctx, store, path=None):
    """Per schedule: offloaded K/V equal the no-offload run's, and so does the output."""
    group = ctx.group if ctx.world_size > 1 else None
    weights = _weights()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10 + ctx.rank))
    report = {}
    for schedule in SCHEDULES:
        ref_out, ref_k, ref_v = _prefill(x, weights, schedule, None, group)
        with _cache(store=store, file=path) as cache:
            out, _, _ = _prefill(x, weights, schedule, cache, group)
            stored = [cache.host_kv(layer) for layer in range(LAYERS)]
        report[schedule] = (torch.equal(out, ref_out),
                            all(torch.equal(k, rk) and torch.equal(v, rv)
                                for (k, v), rk, rv in zip(stored, ref_k, ref_v)))
    return report


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_cache_equals_no_offload_every_schedule(world):
    for rank_report in run_ranks(_schedules_match, world, "memory", timeout=60):
        assert rank_report == {s: (True, True) for s in SCHEDULES}


def test_mmap_store_per_rank_files(tmp_path):
    for rank_report in run_ranks(_schedules_match, 2, "mmap", str(tmp_path), timeout=60):
        assert rank_report == {s: (True, True) for s in SCHEDULES}


def test_mmap_store_folder_gives_one_file_per_rank(tmp_path):
    with _cache(store="mmap", file=str(tmp_path)) as cache:
        assert os.path.dirname(cache.file) == str(tmp_path) and cache.file.endswith("-rank0.kv")
        assert os.path.getsize(cache.file) == cache.host_bytes


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_off_is_identical(store):
    weights, x = _weights(), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    results = []
    for flag, enabled in ((True, True), (True, False), (False, True)):
        with overlap.enabled(flag), _cache(store=store, enabled=enabled) as cache:
            assert cache.asynchronous == (flag and enabled)
            out, _, _ = _prefill(x, weights, "two_batch", cache)
            results.append((out, [cache.host_kv(layer) for layer in range(LAYERS)]))
    for out, kv in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv, results[0][1]) for a, b in ((ka, kb), (va, vb)))


def test_device_store_keeps_everything_and_costs_more_device_memory():
    layers = 6
    weights, x = _weights(layers), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    _, ref_k, ref_v = _prefill(x, weights, "serial")
    slot_bytes = TOKENS * HEADS * DIM * 4 * 2  # K and V of one slot
    peaks = {}
    for store in ("device", "memory"):
        with _cache(n_layers=layers, store=store, ring=2) as cache:
            _prefill(x, weights, "serial", cache)
            peaks[store] = cache.peak_device_bytes
            assert all(torch.equal(cache.get(layer)[0], ref_k[layer]) for layer in range(layers))
            if store == "device":
                assert peaks[store] == cache.peak_device_bytes == layers * slot_bytes and cache.host_bytes == 0
            else:  # a ring of two offload slots, then a ring of two prefetch slots (get() above)
                assert peaks[store] == 2 * slot_bytes and cache.host_bytes == layers * slot_bytes
                assert cache.peak_device_bytes == 4 * slot_bytes
    assert peaks["memory"] < peaks["device"]


# ------------------------------------------------------------------ prefetch
def _offloaded(store="memory", ring=2, **kw):
    weights, x = _weights(), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    _, ref_k, ref_v = _prefill(x, weights, "two_batch")
    cache = _cache(store=store, ring=ring, **kw)
    _prefill(x, weights, "two_batch", cache)
    return cache, ref_k, ref_v


@pytest.mark.parametrize("store,ring", [("memory", 2), ("mmap", 1), ("memory", 3)])
def test_prefetch_round_trip_is_exact(store, ring):
    cache, ref_k, ref_v = _offloaded(store, ring)
    with cache:
        cache.prefetch(0)
        for layer in range(LAYERS):
            if layer + 1 < LAYERS:
                cache.prefetch(layer + 1)  # copied back while this layer computes
            k, v = cache.get(layer)
            torch.relu(k.flatten(1) @ torch.ones(HEADS * DIM, 64))  # this layer's compute
            assert torch.equal(k, ref_k[layer]) and torch.equal(v, ref_v[layer])
        k, v = cache.get(1, 5, 17)  # a range that was never prefetched
        assert torch.equal(k, ref_k[1][5:17]) and torch.equal(v, ref_v[1][5:17])


def test_continue_from_offloaded_prefix_in_a_file(tmp_path):
    path = str(tmp_path / "prefix.kv")
    cache, ref_k, ref_v = _offloaded("mmap", file=path)
    cache.close()
    assert os.path.exists(path)  # a named file outlives the cache
    with _cache(store="mmap", file=path, prefix_tokens=TOKENS) as resumed:
        for layer in range(LAYERS):
            k, v = resumed.get(layer)
            assert torch.equal(k, ref_k[layer]) and torch.equal(v, ref_v[layer])


@pytest.mark.parametrize("store", ["memory", "device"])
def test_acquire_lets_attention_write_the_slot(store, launches):
    weights, x = _weights(), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    _, ref_k, ref_v = _prefill(x, weights, "serial")
    with _cache(store=store) as cache:
        for layer in range(LAYERS):
            k, v = cache.acquire(layer, TOKENS)
            k.copy_(ref_k[layer])
            v.copy_(ref_v[layer])
            cache.offload(layer, k, v)
        assert "kv_stage" not in launches and "kv_keep" not in launches  # written in place, no staging copy
        for layer in range(LAYERS):
            hk, hv = cache.host_kv(layer)
            assert torch.equal(hk, ref_k[layer]) and torch.equal(hv, ref_v[layer])


# ------------------------------------------------------------------ bad input, before any work
class _Launches:
    def __init__(self):
        self.spans = []

    def on_span_start(self, span):
        self.spans.append(span.name)


@pytest.fixture
def launches():
    obs = _Launches()
    hooks.add_observer(obs)
    yield obs.spans
    hooks.remove_observer(obs)


def _kv(tokens, dtype=torch.float32, heads=HEADS, dim=DIM):
    return torch.zeros(tokens, heads, dim, dtype=dtype), torch.zeros(tokens, heads, dim, dtype=dtype)


@pytest.mark.parametrize("args,match", [
    (lambda: (0, *_kv(TOKENS + 1)), "chunk_tokens"),
    (lambda: (0, *_kv(4), TOKENS - 2), "do not fit a host store of max_tokens"),
    (lambda: (0, *_kv(4, torch.float16)), "float16, the cache holds torch.float32"),
    (lambda: (0, *_kv(4, dim=DIM + 1)), r"shape \(4, 2, 9\), expected \(tokens, 2, 8\)"),
    (lambda: (0, _kv(4)[0], _kv(5)[1]), "4 key tokens but 5 value tokens"),
    (lambda: (LAYERS, *_kv(4)), "out of range"),
    (lambda: (0, _kv(4)[0].view(4, -1), _kv(4)[1]), "expected"),
])
def test_bad_offload_is_refused_before_any_copy(args, match, launches):
    with _cache() as cache:
        with pytest.raises(OffloadError, match=match):
            cache.offload(*args())
        assert launches == [] and cache.tokens(0) == 0 and cache.device_bytes == 0


def test_bad_prefetch_is_refused(launches):
    with _cache() as cache:
        with pytest.raises(OffloadError, match="the store holds 0 tokens"):
            cache.prefetch(0)
        cache.offload(0, *_kv(4))
        launches.clear()
        with pytest.raises(OffloadError, match=r"tokens \[0, 5\) requested, the store holds 4"):
            cache.get(0, 0, 5)
        assert launches == []


def test_capacity_check_names_the_numbers():
    with _cache() as cache:
        cache.check_capacity(TOKENS)
        with pytest.raises(OffloadError, match=f"host store too small: {TOKENS + 1} tokens per layer"):
            cache.check_capacity(TOKENS + 1)


def test_store_too_small_for_host_memory_or_disk(monkeypatch, tmp_path):
    import overlap.offload._stores as kvstore

    monkeypatch.setattr(kvstore, "_available_memory", lambda: 1024)
    with pytest.raises(OffloadError, match="host store too small.*need 9.00 KiB, only 1.00 KiB of host memory"):
        _cache(store="memory")
    monkeypatch.setattr(kvstore.shutil, "disk_usage", lambda p: type("U", (), {"free": 1024})())
    with pytest.raises(OffloadError, match="host store too small.*free in"):
        _cache(store="mmap", file=str(tmp_path / "kv.bin"))
    assert not os.path.exists(tmp_path / "kv.bin")


def test_existing_file_of_other_geometry_is_refused(tmp_path):
    path = tmp_path / "kv.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(OffloadError, match=r"holds 100 B \(100 bytes\) but 3 layers x 24 tokens .* need 9.00 KiB"):
        _cache(store="mmap", file=str(path))
    assert path.read_bytes() == b"\0" * 100  # not ours: left as it was
    with pytest.raises(OffloadError, match="prefix_tokens=4 needs an existing mmap file"):
        _cache(store="memory", prefix_tokens=4)


@pytest.mark.parametrize("kw,match", [
    (dict(n_layers=0), "n_layers must be >= 1"),
    (dict(ring=0), "ring must be >= 1"),
    (dict(chunk_tokens=TOKENS + 1), "chunk_tokens"),
    (dict(store="disk"), "unknown store 'disk'"),
    (dict(kv_shape=(HEADS, 0)), "positive sizes"),
    (dict(dtype=torch.int64), "floating point"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be >= 1, got -3"),
    (dict(ring=-1), "ring must be >= 1"),
    (dict(n_layers=2.5), "n_layers must be an integer, got 2.5"),
    (dict(max_tokens=None), "max_tokens must be an integer, got None"),
    (dict(kv_shape=()), "positive sizes"),
    (dict(kv_shape=(HEADS, 2.5)), "kv_shape must be an integer"),
    (dict(prefix_tokens=TOKENS + 1), "prefix_tokens=25 must lie in"),
    (dict(store=None), "unknown store None"),
    (dict(device="meta"), "device meta holds no data"),
    (dict(name=3), "name must be a string"),
])
def test_bad_construction(kw, match):
    with pytest.raises(OffloadError, match=match):
        _cache(**kw)


def test_sizes_read_in_units_that_never_round_to_zero():
    from overlap.offload._stores import human_bytes

    assert [human_bytes(n) for n in (0, 512, 1024, 12 * 1024, int(3.4 * 2**20), int(1.2 * 2**30), 2**20 - 1)] == [
        "0 B", "512 B", "1.00 KiB", "12.0 KiB", "3.40 MiB", "1.20 GiB", "1.00 MiB"]
    with _cache() as cache, pytest.raises(OffloadError, match=r"\(9.00 KiB; 9.38 KiB needed\)"):
        cache.check_capacity(TOKENS + 1)


@pytest.mark.parametrize("call,match", [
    (lambda c: c.offload(0.5, *_kv(4)), "layer must be an integer, got 0.5"),
    (lambda c: c.offload(0, *_kv(4), offset="3"), "offset must be an integer"),
    (lambda c: c.acquire(0, 2.5), "tokens must be an integer, got 2.5"),
    (lambda c: c.get(0, None), "start must be an integer, got None"),
    (lambda c: c.prefetch(0, -1, 2), r"tokens \[-1, 2\) requested"),
    (lambda c: c.tokens("0"), "layer must be an integer"),
])
def test_bad_numbers_are_refused_before_any_copy(call, match, launches):
    with _cache() as cache:
        with pytest.raises(OffloadError, match=match):
            call(cache)
        assert launches == [] and cache.tokens(0) == 0


class _Elsewhere(torch.Tensor):
    """A tensor that reports another device than the one its data is on."""

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.mark.parametrize("store", ["memory", "device"])
def test_keys_or_values_on_another_device_are_refused_naming_both(store, launches):
    meta = torch.empty(4, HEADS, DIM, device="meta")
    elsewhere = _kv(4)[0].as_subclass(_Elsewhere)
    with _cache(store=store) as cache:
        for k, v, match in ((meta, _kv(4)[1], "keys of layer 0 are on meta, the cache works on cpu"),
                            (_kv(4)[0], meta, "values of layer 0 are on meta, the cache works on cpu"),
                            (meta.half(), _kv(4)[1], "keys of layer 0 are on meta"),  # the device is named first
                            (elsewhere, _kv(4)[1], "keys of layer 0 are on cuda:1, the cache works on cpu")):
            with pytest.raises(OffloadError, match=match):
                cache.offload(0, k, v)
        assert launches == [] and cache.tokens(0) == 0


def test_device_without_an_index_matches_its_tensors():
    with _cache(device="cpu:0") as cache:  # the index tensors report, as "cuda" must match cuda:0 tensors
        cache.offload(0, *_kv(4))
        assert cache.device == torch.device("cpu") and cache.tokens(0) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_refused():
    with pytest.raises(OffloadError, match="device cuda is not available"):
        _cache(device="cuda")


def test_store_that_cannot_be_allocated_is_refused(monkeypatch):
    import overlap.offload._stores as kvstore

    monkeypatch.setattr(kvstore, "_available_memory", lambda: None)
    for store, where in (("memory", "of host memory"), ("device", "on cpu")):
        with pytest.raises(OffloadError, match=f"cannot allocate the {store} store: .* need 4096 PiB {where}"):
            _cache(n_layers=1, max_tokens=2**58, kv_shape=2, store=store)


@pytest.mark.parametrize("store", ["memory", "mmap", "device"])
def test_closed_cache_refuses_every_call(store):
    cache = _cache(store=store)
    cache.offload(0, *_kv(4))
    cache.close()
    cache.close()  # twice is fine
    cache.finish()  # nothing to wait for
    calls = (lambda: cache.offload(0, *_kv(4)), lambda: cache.acquire(0, 4), lambda: cache.prefetch(0),
             lambda: cache.get(0), lambda: cache.host_kv(0), cache.reset, lambda: cache.tokens(0),
             lambda: cache.check_capacity(4), cache.__enter__)
    for call in calls:
        with pytest.raises(OffloadError, match=f"OffloadCache '{cache.name}' is closed"):
            call()
    assert cache.closed and cache.device_bytes == 0


def test_two_open_caches_cannot_share_a_name():
    with _cache(name="kvsame"):  # they would share events: one cache's copies would wait on the other's
        with pytest.raises(OffloadError, match="a cache named 'kvsame' is open already"):
            _cache(name="kvsame")
    with _cache(name="kvsame"):
        pass


# ------------------------------------------------------------------ mmap files: disk full, paths, leftovers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code, *args, tmpdir=None, **kw):
    """``code`` in a fresh interpreter at the repository root (TMPDIR=``tmpdir``)."""
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


_OVER_THE_LIMIT = """
import json, resource, signal, sys
from overlap import OffloadCache, OffloadError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, no signal
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
out = {}
for file in (sys.argv[1], None):  # 4 x 4096 x 32 floats = 2 MiB, over the 64 KiB limit
    try:
        cache = OffloadCache(4, 4096, (2, 8), device="cpu", store="mmap", file=file, name="kv")
        cache.offload(0, *[__import__("torch").ones(4096, 2, 8)] * 2)
        cache.finish()
        out[str(file)] = "no error"
    except OffloadError as e:
        out[str(file)] = "OffloadError: " + str(e)
    except Exception as e:
        out[str(file)] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def test_mmap_store_that_cannot_grow_is_refused_before_the_first_write(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    path = tmp_path / "kv.bin"
    proc = _python(_OVER_THE_LIMIT, path, tmpdir=tmp)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err  # never a SIGBUS / SIGXFSZ
    res = json.loads(out)
    assert res[str(path)].startswith(f"OffloadError: host store file {path} cannot grow to 2.00 MiB (2097152 bytes)")
    assert res["None"].startswith("OffloadError: host store file ") and "cannot grow to 2.00 MiB" in res["None"]
    assert not path.exists() and list(tmp.iterdir()) == []  # nothing left behind


def test_full_disk_is_refused_naming_the_file_the_bytes_needed_and_free(monkeypatch, tmp_path):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / "kv.bin"
    with pytest.raises(OffloadError, match=(rf"host store too small: 3 layers x 24 tokens of keys and values need "
                                            rf"9.00 KiB \(9216 bytes\) in {re.escape(str(path))}, only "
                                            rf"\d[\d.]* [KMGTP]?i?B free in {re.escape(str(tmp_path))}")):
        _cache(store="mmap", file=str(path))
    with pytest.raises(OffloadError, match="host store too small: .* need 9.00 KiB"):
        _cache(store="mmap")  # a temporary file
    assert list(tmp_path.iterdir()) == []  # the files it created are gone
    path.write_bytes(bytes(9216))  # a file written earlier (e.g. a prefix) is reported and kept
    with pytest.raises(OffloadError, match="host store too small"):
        _cache(store="mmap", file=str(path), prefix_tokens=4)
    assert path.stat().st_size == 9216


def test_mmap_store_reserves_its_blocks(tmp_path):
    path = tmp_path / "kv.bin"
    with _cache(store="mmap", file=str(path)):
        assert path.stat().st_blocks * 512 >= 9216  # allocated, not a sparse file


_HOLD = """
import sys, time, torch
from overlap import OffloadCache
cache = OffloadCache(2, 64, (2, 8), device="cpu", store="mmap", file=sys.argv[1] if len(sys.argv) > 1 else None,
                     name="kv")
cache.offload(0, torch.ones(64, 2, 8), torch.ones(64, 2, 8))
cache.finish()
print(cache.file, flush=True)
time.sleep(120)
"""


def test_temporary_store_leaves_nothing_even_when_killed(tmp_path):
    proc = _python(_HOLD, tmpdir=tmp_path)
    try:
        assert proc.stdout.readline(), proc.stderr.read()  # the store is open and written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_temporary_store_has_no_name_and_works(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache, ref_k, ref_v = _offloaded("mmap")
    with cache:
        assert cache.file is None and list(tmp_path.iterdir()) == []
        assert all(torch.equal(cache.get(layer)[0], ref_k[layer]) for layer in range(LAYERS))
    with pytest.raises(KeyboardInterrupt), _cache(store="mmap"):
        raise KeyboardInterrupt  # Ctrl-C inside the with block
    assert list(tmp_path.iterdir()) == []


def test_a_file_another_cache_holds_is_refused(tmp_path):
    path = str(tmp_path / "kv.bin")
    with _cache(store="mmap", file=path):
        with pytest.raises(OffloadError, match="kv.bin is in use by another open cache"):
            _cache(store="mmap", file=path)
    with _cache(store="mmap", file=path):  # free again once closed
        pass
    # another process (a rank sharing the folder without torch.distributed) holds kv-rank0.kv
    proc = _python(_HOLD, tmp_path)
    try:
        assert proc.stdout.readline().strip() == str(tmp_path / "kv-rank0.kv")
        with pytest.raises(OffloadError, match="kv-rank0.kv is in use by another open cache"):
            _cache(store="mmap", file=str(tmp_path), name="kv")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert os.path.getsize(tmp_path / "kv-rank0.kv") == 2 * 64 * 2 * 8 * 4 * 2  # the other's file is untouched


@pytest.mark.parametrize("where,kw,match", [
    (lambda t: t / "missing" / "kv.bin", {}, r"cannot create the host store file .*kv.bin: folder .*missing does not"),
    (lambda t: "/proc/overlap-kv.bin", {}, "cannot create the host store file /proc/overlap-kv.bin: "),
    (lambda t: "/dev/null", {}, "host store file /dev/null is not a regular file"),
    (lambda t: t / "prefix.kv", dict(prefix_tokens=4), "prefix_tokens=4 needs an existing mmap file holding that "
                                                      r"prefix; .*prefix.kv does not exist"),
    (lambda t: None, dict(prefix_tokens=4), "prefix_tokens=4 needs an existing mmap file"),
    (lambda t: t, dict(name="a/b"), "cache name 'a/b' cannot name a file in .*: it holds a path separator"),
])
def test_bad_mmap_file_is_refused_and_nothing_is_created(where, kw, match, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = where(tmp_path)
    with pytest.raises(OffloadError, match=match):
        _cache(store="mmap", file=None if target is None else str(target), **kw)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_in_the_store_files_place_is_refused_as_not_a_regular_file(tmp_path):
    """In a folder given as ``file=`` (the launcher's ``--out/kv``), this rank's file name taken by a folder
    (before: "cannot open the host store file ... for reading and writing: Is a directory")."""
    (tmp_path / "kv-rank0.kv").mkdir()
    with pytest.raises(OffloadError, match=r"host store file .*kv-rank0.kv is not a regular file \(a folder\)"):
        _cache(store="mmap", file=str(tmp_path), name="kv")
    assert [p.name for p in tmp_path.iterdir()] == ["kv-rank0.kv"] and not os.listdir(tmp_path / "kv-rank0.kv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_folder_or_file_without_write_permission_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(OffloadError, match="cannot create the host store file .*: Permission denied"):
            _cache(store="mmap", file=str(folder / "kv.bin"))
    finally:
        folder.chmod(0o700)
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes(9216))
    path.chmod(0o400)
    with pytest.raises(OffloadError, match="cannot open the host store file .* for reading and writing: Permission"):
        _cache(store="mmap", file=str(path), prefix_tokens=4)


@pytest.mark.parametrize("path", ["ge", "aclgraph"])
def test_graph_paths_refuse_the_copy_stream(path):
    with overlap.use_path(path):
        with pytest.raises(OffloadError, match=f"not available on the '{path}' path: a copy into host memory"):
            _cache()
        with _cache(enabled=False) as cache:  # the documented fallback: plain copies, no side stream
            assert not cache.asynchronous
    with _cache() as cache:  # made eagerly, then used inside a compiled region
        with overlap.use_path(path), pytest.raises(OffloadError, match="cannot be expressed inside a compiled"):
            cache.offload(0, *_kv(4))
        assert cache.tokens(0) == 0


# ------------------------------------------------------------------ sanitizer and timeline
def _offload_and_prefetch(cache, weights, x):
    _prefill(x, weights, "two_batch", cache)  # 2 micro-batches x LAYERS offloads: every slot is reused
    cache.prefetch(0)
    for layer in range(LAYERS):
        if layer + 1 < LAYERS:
            cache.prefetch(layer + 1)
        k, v = cache.get(layer)
        torch.relu(k.flatten(1) @ torch.ones(HEADS * DIM, 8)) + v.sum()
    return [cache.host_kv(layer) for layer in range(LAYERS)]


def test_sanitizer_finds_no_race():
    from overlap.observability.sanitizer import Sanitizer

    weights, x = _weights(), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    with Sanitizer() as san, _cache(ring=2) as cache:
        _offload_and_prefetch(cache, weights, x)
    assert san.races == []


@pytest.mark.parametrize("direction,wait,kind", [
    ("offload", "_wait_written", "read after write"),  # the copy stream reads the slot before attention's write is done
    ("offload", "_wait_stored", "write after read"),  # attention overwrites a slot still being copied out
    ("prefetch", "_wait_free", "write after read"),  # a prefetch overwrites a slot the main stream still reads
    ("prefetch", "_wait_ready", "read after write"),  # the main stream reads a prefetch slot before it has landed
])
def test_sanitizer_catches_a_removed_wait(direction, wait, kind, monkeypatch):
    from overlap.observability.sanitizer import Sanitizer, StreamRaceError

    weights, x = _weights(), torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    with _cache(ring=2) as cache:
        ring = cache.rings[("offload", "prefetch").index(direction)]  # the direction's ring, which owns the wait
        monkeypatch.setattr(ring, wait, lambda slot, k, v: (k, v))
        with Sanitizer() as san, pytest.raises(StreamRaceError):
            _offload_and_prefetch(cache, weights, x)
    assert [r.kind for r in san.races] == [kind]
    assert {san.races[0].previous.stream, san.races[0].current.stream} == {overlap.DEFAULT, overlap.KV_OFFLOAD}


def test_timeline_shows_copies_under_compute():
    from overlap.observability.timeline import Timeline, intersects

    tokens, heads, dim, hidden = 256, 8, 64, 256  # copies long enough to outlast the launch gap
    weights = _weights(LAYERS, hidden, heads, dim)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8))
    for _ in range(5):  # a loaded host may run a whole copy between two launches; then look again
        with _cache(max_tokens=tokens, kv_shape=(heads, dim)) as cache:
            with Timeline() as tl:
                h = x
                for layer, w in enumerate(weights):
                    with overlap.span("attn", layer=layer):
                        k, v, a = _attention(h, w, heads, dim)
                    cache.offload(layer, k, v)
                    with overlap.span("mlp", layer=layer):
                        h = torch.tanh(a @ w["wo"]) + h
                cache.finish()
        copies = tl.find(name="kv_offload", stream=overlap.KV_OFFLOAD, kind="copy")
        compute = tl.find(stream=overlap.DEFAULT, kind="compute")
        assert len(copies) == 2 * LAYERS and len(compute) == 2 * LAYERS
        assert all(c.asynchronous for c in copies)
        if any(intersects(c, m) for c in copies for m in compute):
            return
    pytest.fail("no offload copy ran under compute in 5 runs")


def test_benchmark_runs_and_prints_both_modes():
    from click.testing import CliRunner

    from launch.bench.offload import main

    res = CliRunner().invoke(main, ["--layers", "2", "--tokens", "32", "--hidden", "32", "--heads", "2",
                                    "--head-dim", "8", "--repeats", "3"])
    assert res.exit_code == 0, res.output
    for line in ("keep", "offload sync", "offload overhead", "device KV memory", "copy time hidden by the stream: "):
        assert line in res.output
    assert res.output.splitlines()[2].split() == ["mode", "prefill", "ms", "spread", "vs", "keep", "device", "KV",
                                                  "MiB", "host", "KV", "MiB"]
    assert "medians of 3 round(s), the modes interleaved" in res.output
    assert re.search(r"^offload overhead (\+[0-9.]+%|below the noise|none measured) \(spread [0-9.]+%\); target <= 5%: "
                     r"(met|missed|inconclusive \(noise\))$", res.output, re.M), res.output


def test_reference_model_kv_sink_is_offload():
    from launch.models import build_model, preset
    from microbatch.batch import Batch

    cfg = preset("tiny")
    model, batch = build_model(cfg), Batch.random([20, 12], cfg.vocab)
    seen = {}
    ref = model(batch, kv_sink=lambda layer, k, v: seen.setdefault(layer, (k.clone(), v.clone())))
    with _cache(n_layers=cfg.n_layers, max_tokens=32, kv_shape=(cfg.n_heads, cfg.head_dim)) as cache:
        assert torch.equal(model(batch, kv_sink=cache.offload), ref)
        for layer, (k, v) in seen.items():
            hk, hv = cache.host_kv(layer)
            assert torch.equal(hk, k) and torch.equal(hv, v)


def test_close_releases_the_cache_events():
    from overlap.state import STATE

    cache = OffloadCache(2, 8, (2, 4), name="kvrelease")
    cache.offload(0, torch.ones(8, 2, 4), torch.ones(8, 2, 4))
    assert any(t.startswith("kvrelease.") for t in STATE.events)
    cache.close()
    assert not any(t.startswith("kvrelease.") for t in STATE.events)


def test_event_tags_per_slot_and_reset():
    from overlap.state import STATE

    with OffloadCache(2, 8, (2, 4), ring=2, name="kvtags") as cache:
        assert repr(cache) == ("OffloadCache(kvtags: 2 layers x 8 tokens, k(2, 4) v(2, 4) torch.float32, store=memory, "
                               "ring=2, asynchronous=True)")
        cache.offload(0, torch.ones(8, 2, 4), torch.ones(8, 2, 4))
        k, _ = cache.get(0)
        assert torch.equal(k, torch.ones(8, 2, 4))
        tags = {t for t in STATE.events if t.startswith("kvtags.")}
        assert tags == {f"kvtags.{d}.{e}{i}" for d, pair in (("offload", ("written", "stored")),
                                                            ("prefetch", ("free", "ready")))
                        for e in pair for i in range(2)}
        cache.reset()
        assert cache.tokens(0) == 0
        with pytest.raises(OffloadError, match="the store holds 0 tokens"):
            cache.get(0)
        cache.offload(0, torch.full((4, 2, 4), 2.0), torch.full((4, 2, 4), 3.0))
        hk, hv = cache.host_kv(0)
        assert torch.equal(hk, torch.full((4, 2, 4), 2.0)) and torch.equal(hv, torch.full((4, 2, 4), 3.0))
        slot_bytes = 2 * 8 * 2 * 4 * 4  # K and V of 8 tokens
        assert cache.device_bytes == cache.peak_device_bytes == 3 * slot_bytes  # both offload slots, one prefetch slot
    assert cache.device_bytes == 0
