"""Decode with the KV cache in host memory (`microbatch.OffloadedKVCache`): the tokens of the device cache in
every mode, each layer's history prefetched on the ``kv_offload`` stream under the layer before, race-free
(each of its four waits needed), and a report whose counts and bytes add up."""
import dataclasses

import pytest
import torch

import overlap
from launch.engine import greedy_generate
from launch.models import build_model, preset
from microbatch import KVCache, KVCacheError, KVStep, OffloadedKVCache
from overlap import Sanitizer, StreamRaceError
from overlap.offload import Ring

pytestmark = pytest.mark.cpu_only

CFG = preset("tiny")  # 3 layers (an odd count: a step's layer 0 reuses the buffer of the last one), dense and MoE
MODEL = build_model(CFG, seed=4)
PROMPTS = [[5, 9, 2, 7, 1, 3], [3, 1, 4], [8, 8, 4, 2, 6, 6, 1, 9, 3], [2, 7], [1, 1, 5, 9, 2]]
NEW = 5


def _offloaded(prompts=PROMPTS, new=NEW, **kw):
    return OffloadedKVCache(CFG.n_layers, len(prompts), max(map(len, prompts)) + new, CFG.k_shape, CFG.v_shape, **kw)


def _row_bytes(cache):
    """Bytes of one token's key and value."""
    return sum(t[0, 0, 0].numel() * t.element_size() for t in (cache.k, cache.v))


@pytest.mark.parametrize("mode", ["serial", "shared", "two-batch"])
def test_tokens_equal_the_device_caches_and_nothing_races(mode):
    want = greedy_generate(MODEL, PROMPTS, NEW, mode=mode)
    stop = want[1][1]  # request 1 stops after two tokens: its slot is freed while the others go on
    want_stopped = greedy_generate(MODEL, PROMPTS, NEW, stop_token=stop, mode=mode)
    for stop_token, expected in ((None, want), (stop, want_stopped)):
        with _offloaded() as cache, Sanitizer():  # raises on the first race between streams
            assert greedy_generate(MODEL, PROMPTS, NEW, stop_token=stop_token, cache=cache, mode=mode) == expected


def test_prefill_cut_between_micro_batches_and_either_order_of_write_and_history():
    """At the cache itself, against `KVCache`: a prefill written by two micro-batches that cut a request (the
    rows' ``where`` cut, as a split prefill passes them), then decode steps of two micro-batches whose slots
    are not neighbours, one writing before reading its history (`KVStep.attend`), the other reading first (the
    transformers adapter); the buffers are as big as the ring of each micro-batch's requests."""
    g = torch.Generator().manual_seed(1)
    lens, layers, shape = [4, 7, 2, 5], 3, (2, 8)
    plain = KVCache(layers, 4, 12, shape)
    with OffloadedKVCache.like(plain) as cache, Sanitizer():  # the launcher makes it from `new_cache`'s
        assert (cache.k.shape, cache.v.shape, cache.max_len, cache.device) == (plain.k.shape, plain.v.shape, 12,
                                                                                plain.device)
        both = (plain, cache)
        for c in both:
            c.admit(4)
        rows = [c.rows([0, 1, 2, 3], lens) for c in both]
        cut = 6  # request 1's rows 2.. are the second micro-batch's
        for layer in range(layers):
            k, v = torch.randn(sum(lens), *shape, generator=g), torch.randn(sum(lens), *shape, generator=g)
            for c, r in zip(both, rows):
                for lo, hi in ((0, cut), (cut, sum(lens))):
                    c.write(layer, dataclasses.replace(r, where=r.where[lo:hi]), k[lo:hi], v[lo:hi])
        for c, r in zip(both, rows):
            c.advance(r)
        assert cache.device_bytes == 2 * 4 * 12 * _row_bytes(cache)  # a ring of two buffers of the 4 requests
        parts = [[0, 2], [3]]
        for step in range(3):
            if step == 2:
                parts = [[0], [2, 3]]  # request 1 is done
                for c in both:
                    c.release([1])
            steps = [[KVStep(c, c.rows(p)) for p in parts] for c in both]
            for layer in range(layers):
                for (ps, cs), order in zip(zip(*steps), ("write first", "history first")):
                    n = len(ps.rows.slots)
                    q, k, v = (torch.randn(n, *shape, generator=g) for _ in range(3))
                    if order == "write first":
                        assert torch.equal(cs.attend(layer, q, k, v), ps.attend(layer, q, k, v))
                    else:
                        got, want = cs.cache.history(layer, cs.rows), ps.cache.history(layer, ps.rows)
                        for i, s in enumerate(ps.rows.slots):  # the rows held (the rest is padding)
                            held = plain.lengths[s]
                            assert all(torch.equal(x[i, :held], y[i, :held]) for x, y in zip(got, want))
                        for s in (ps, cs):
                            s.cache.write(layer, s.rows, k, v)
            for c, ss in zip(both, steps):
                for s in ss:
                    c.advance(s.rows)
        cache.finish()
        assert torch.equal(cache.k[:, [0, 2, 3]], plain.k[:, [0, 2, 3]])  # the host store holds every row
        assert torch.equal(cache.v[:, [0, 2, 3]], plain.v[:, [0, 2, 3]])


def test_a_layer_read_again_after_the_ring_moved_on_is_fetched_again_with_the_steps_rows():
    g = torch.Generator().manual_seed(2)
    plain, shape = KVCache(3, 2, 8, (2, 4)), (2, 4)
    with OffloadedKVCache(3, 2, 8, shape) as cache:
        steps = []
        for c in (plain, cache):
            c.admit(2)
            prefill = c.rows([0, 1], [3, 5])
            for layer in range(3):
                c.write(layer, prefill, torch.ones(8, *shape) * layer, torch.ones(8, *shape))
            c.advance(prefill)
            steps.append(KVStep(c, c.rows([0, 1])))
        for layer in range(3):  # layer 2 takes layer 0's buffer
            q, k, v = (torch.randn(2, *shape, generator=g) for _ in range(3))
            assert torch.equal(steps[1].attend(layer, q, k, v), steps[0].attend(layer, q, k, v))
        again = [s.cache.history(0, s.rows) for s in steps]
        for i, n in enumerate((3 + 1, 5 + 1)):  # each request's rows, the step's new one of layer 0 included
            assert all(torch.equal(a[i, :n], b[i, :n]) for a, b in zip(*again))


@pytest.mark.parametrize("wait,kind", [
    ("_wait_free", "write after read"),  # a prefetch overwrites a buffer while attention still reads it
    ("_wait_ready", "write after write"),  # the step's new rows go into a buffer the prefetch has not filled yet
    ("_wait_written", "read after write"),  # the write-back reads the new rows before they are in the buffer
    ("_wait_stored", "write after read"),  # a prefill layer writes a buffer the write-back still reads
])
def test_each_wait_is_needed(wait, kind, monkeypatch):
    with _offloaded() as cache:
        monkeypatch.setattr(Ring, wait, lambda self, slot, k, v: (k, v))  # the rings the cache makes per micro-batch
        with Sanitizer() as san, pytest.raises(StreamRaceError):
            greedy_generate(MODEL, PROMPTS, NEW, cache=cache)
    assert san.races[0].kind == kind
    assert {san.races[0].previous.stream, san.races[0].current.stream} == {overlap.DEFAULT, overlap.KV_OFFLOAD}


def test_prefetches_run_on_the_offload_stream_under_the_layer_before():
    """Each prefetch of layer L (L > 0) is issued before its micro-batch's attention of layer L, on the offload
    stream, and one of them at least runs while layer L-1 computes; each write-back is issued in its layer."""
    from overlap.observability.timeline import intersects

    prompts = [list(range(1, 40)), list(range(2, 50)), list(range(3, 45)), list(range(4, 60))]  # longer copies
    steps = NEW - 1
    for _ in range(5):  # a loaded host may run a whole copy between two launches; then look again
        with _offloaded(prompts) as cache, overlap.Timeline() as tl:
            greedy_generate(MODEL, prompts, NEW, cache=cache, mode="two-batch")
            cache.finish()
        spans = tl.spans
        copies = [s for s in spans if s.name == "kv_prefetch"]
        compute = [s for s in spans if s.stream == overlap.DEFAULT and s.kind == "compute"]
        assert len(copies) == CFG.n_layers * steps * 2
        assert all(c.stream == overlap.KV_OFFLOAD and c.kind == "copy" and c.asynchronous for c in copies)
        assert sorted(c.meta["layer"] for c in copies) == sorted(list(range(CFG.n_layers)) * steps * 2)
        ahead = [c for c in copies if c.meta["layer"] > 0]
        for c in ahead:  # issued from its micro-batch's attention of the layer before, so before the next one
            later = [m for m in compute if m.name == "attn" and m.meta["mb"] == c.meta["mb"] and m.start > c.start]
            assert later and min(later, key=lambda m: m.start).meta["layer"] == c.meta["layer"]
        stores = [s for s in spans if s.name == "kv_store"]
        assert len(stores) == CFG.n_layers * (1 + steps * 2) and {s.stream for s in stores} == {overlap.KV_OFFLOAD}
        for s in stores:  # the next compute to start is the same layer's: sent right after the layer's write
            nxt = min((m for m in compute if m.start > s.start), key=lambda m: m.start)
            assert nxt.meta["layer"] == s.meta["layer"]
        if any(intersects(c, m) for c in ahead for m in compute if m.meta["layer"] == c.meta["layer"] - 1):
            return
    pytest.fail("no prefetch ran under the layer before in 5 runs")


def test_report_counts_every_prefetch_and_its_bytes():
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [2, 4, 6, 8]]  # one length
    steps, layers, p = NEW - 1, CFG.n_layers, len(prompts[0])
    with _offloaded(prompts) as cache:
        assert greedy_generate(MODEL, prompts, NEW, cache=cache, mode="two-batch") == \
            greedy_generate(MODEL, prompts, NEW, mode="two-batch")
        report = cache.prefetch_report()
        row = _row_bytes(cache)
    assert report.count == layers * steps * 2  # per layer, step and micro-batch; nothing to copy in the prefill
    held = sum(p + s for s in range(steps))  # rows each request holds before decode step s + 1
    assert report.bytes == layers * len(prompts) * held * row
    assert report.stores == layers * (1 + steps * 2)  # the prefill's, then each step's micro-batches'
    assert report.store_bytes == layers * (len(prompts) * p + steps * len(prompts)) * row
    assert 0 <= report.exposed_s <= report.seconds and 0 <= report.hidden_share <= 1
    assert str(report).startswith(f"KV prefetch: {report.count} copies, ") and "hidden" in str(report)


def test_with_overlap_off_the_copies_are_the_main_streams_and_nothing_is_hidden():
    with overlap.enabled(False), _offloaded() as cache:
        assert greedy_generate(MODEL, PROMPTS, NEW, cache=cache) == greedy_generate(MODEL, PROMPTS, NEW)
        report = cache.prefetch_report()
    assert report.count == CFG.n_layers * (NEW - 1) and report.hidden_share in (0.0, None)


def test_bad_input_and_use_after_close_are_refused():
    with pytest.raises(KVCacheError, match="ring must be an integer of at least 2, got 1"):
        _offloaded(ring=1)
    with overlap.use_path("ge"), pytest.raises(KVCacheError, match="not available on the 'ge' path: a copy"):
        _offloaded()
    cache = _offloaded()
    cache.admit(1)
    with overlap.use_path("aclgraph"), pytest.raises(KVCacheError, match="not available on the 'aclgraph' path"):
        cache.rows([0], [3])  # made eagerly, then used inside a compiled region
    cache.write(0, cache.rows([0], [3]), torch.ones(3, *CFG.k_shape), torch.ones(3, *CFG.v_shape))
    from overlap.state import STATE

    assert any(t.startswith(f"{cache.name}.") for t in STATE.events)
    cache.close()
    cache.close()  # twice is fine
    assert not any(t.startswith(f"{cache.name}.") for t in STATE.events)
    with pytest.raises(KVCacheError, match=f"OffloadedKVCache '{cache.name}' is closed"):
        cache.rows([0], [1])
    assert cache.prefetch_report().stores == 1  # the numbers stay readable
