"""The one offload mechanism (`overlap.offload.Ring`): its slots reused, its events ordering each copy after the
main stream's use of a slot (a refill after the previous drain), its meters; and both KV caches that live on the
host, prefill's `OffloadCache` and decode's `OffloadedKVCache`, stage through it rather than a ring of their own."""
import ast
import os

import pytest
import torch

import overlap
from launch.engine import greedy_generate
from launch.models import build_model, preset
from microbatch import OffloadedKVCache
from overlap import OffloadCache, Sanitizer, StreamRaceError
from overlap.offload import DeviceBytes, PrefetchMeter, Ring, issue_copies
from overlap.state import STATE

pytestmark = pytest.mark.cpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, WIDTH = 4, 8  # a slot: 4 rows of 8 keys and 8 values
SLOT_BYTES = 2 * ROWS * WIDTH * 4  # K and V, float32
# the modules of the two caches: what they copy is theirs, the slots, events and copy stream are the ring's
CACHES = ("overlap/offload/cache.py", "overlap/offload/_offload.py", "overlap/offload/_prefetch.py",
          "overlap/offload/_keep.py", "microbatch/kv_offload.py")
RING_NAMES = {"KV_OFFLOAD", "event", "Event", "record_stream", "release_events", "stream", "current_stream_tag"}


def _ring(name="ringtest", size=2, **kw):
    return Ring(name, size, (WIDTH,), (WIDTH,), torch.float32, torch.device("cpu"), kw.pop("device_bytes", None)
                or DeviceBytes(), **kw)


class _Order:
    """Records the events recorded and waited for, in order, with their streams."""

    def __init__(self):
        self.seen = []

    def on_event_record(self, name, stream):
        self.seen.append(("record", name, stream))

    def on_event_wait(self, name, stream):
        self.seen.append(("wait", name, stream))


def _drain(ring, slot, host):
    ring.drain(slot, lambda k, v: issue_copies("drain", [(host[0], k), (host[1], v)]), SLOT_BYTES)


def _fill(ring, slot, host):
    ring.fill(slot, lambda k, v, timing: issue_copies("fill", [(k, host[0]), (v, host[1])], timing), SLOT_BYTES)


def _use(ring, layers, host, wait_drained=True):
    """Each layer written into the next slot on the main stream and drained to ``host``; then layer 0 filled back
    into its slot, which a later layer has been drained from, and read."""
    for layer in range(layers):
        slot = ring.take()
        if wait_drained:
            ring.wait_drained(slot)
        k, v = ring.buffers(slot, ROWS)
        k.copy_(torch.full((ROWS, WIDTH), float(layer)))
        v.copy_(torch.full((ROWS, WIDTH), -float(layer)))
        _drain(ring, slot, host[layer])
    _fill(ring, 0, host[0])
    k, v = ring.wait_filled(0)
    return k.sum().item(), v.sum().item()


def test_a_slot_is_reused_and_each_copy_ordered_after_the_main_streams_use_of_it():
    host = torch.zeros(3, 2, ROWS, WIDTH)
    meter = DeviceBytes()
    ring = _ring(device_bytes=meter)
    order = _Order()
    overlap.add_observer(order)
    try:
        with Sanitizer():  # raises on the first race between the streams
            buffers = [ring.buffers(slot, ROWS) for slot in range(2)]
            assert _use(ring, 3, host) == (0.0, 0.0)  # layer 0's keys and values, back from the host
            ring.synchronize()
    finally:
        overlap.remove_observer(order)
    assert all(torch.equal(host[layer, 0], torch.full((ROWS, WIDTH), float(layer))) for layer in range(3))
    assert [ring.buffers(slot, ROWS) for slot in range(2)] == buffers  # the same buffers, reused
    assert meter.now == meter.peak == 2 * SLOT_BYTES
    assert {t for t in STATE.events if t.startswith("ringtest.")} == {
        f"ringtest.{e}{i}" for e in ("free", "ready", "written", "stored") for i in range(2)}
    slot0 = [(what, tag[len("ringtest."):], stream) for what, tag, stream in order.seen if tag.endswith("0")]
    main, copy = overlap.DEFAULT, overlap.KV_OFFLOAD
    assert slot0 == [
        ("record", "written0", main), ("wait", "written0", copy), ("record", "stored0", copy),  # layer 0 drained
        ("wait", "stored0", main),  # before layer 2 is written into the slot
        ("record", "written0", main), ("wait", "written0", copy), ("record", "stored0", copy),  # layer 2 drained
        ("record", "free0", main), ("wait", "free0", copy), ("record", "ready0", copy),  # the refill, after it
        ("wait", "ready0", main),  # before the main stream reads it
    ]
    ring.close()
    assert meter.now == 0 and meter.peak == 2 * SLOT_BYTES
    assert not any(t.startswith("ringtest.") for t in STATE.events)


def test_writing_a_slot_before_its_drain_is_done_is_a_race():
    ring = _ring()
    with Sanitizer() as san, pytest.raises(StreamRaceError):
        _use(ring, 3, torch.zeros(3, 2, ROWS, WIDTH), wait_drained=False)
    assert san.races[0].kind == "write after read"
    assert {san.races[0].previous.stream, san.races[0].current.stream} == {overlap.DEFAULT, overlap.KV_OFFLOAD}
    ring.close()


def test_the_meters_count_device_bytes_prefetches_and_write_backs():
    device_bytes, prefetches = DeviceBytes(), PrefetchMeter()
    ring = _ring(device_bytes=device_bytes, prefetches=prefetches)
    ring.buffers(0, 2)
    assert device_bytes.now == SLOT_BYTES // 2
    ring.buffers(0, 1)  # big enough: kept
    assert device_bytes.now == SLOT_BYTES // 2
    ring.buffers(0, ROWS)  # too small: replaced
    ring.buffers(1, ROWS)
    assert device_bytes.now == device_bytes.peak == 2 * SLOT_BYTES
    host = torch.randn(2, 2, ROWS, WIDTH)
    _fill(ring, 0, host[0])
    k, _ = ring.wait_filled(0)
    assert torch.equal(k, host[0, 0])
    _drain(ring, 1, host[1])
    ring.synchronize()
    report = prefetches.report()
    assert (report.count, report.bytes, report.stores, report.store_bytes) == (1, SLOT_BYTES, 1, SLOT_BYTES)
    assert 0 <= report.exposed_s <= report.seconds and 0 <= report.hidden_share <= 1
    assert str(report).startswith("KV prefetch: 1 copies, ")
    ring.close()
    assert device_bytes.now == 0 and device_bytes.peak == 2 * SLOT_BYTES


def test_a_ring_that_is_not_asynchronous_copies_on_the_current_stream_and_hides_nothing():
    prefetches = PrefetchMeter()
    ring = _ring(asynchronous=False, prefetches=prefetches)
    host = torch.randn(2, ROWS, WIDTH)
    order = _Order()
    with overlap.Timeline() as tl:
        overlap.add_observer(order)
        ring.buffers(0, ROWS)
        _fill(ring, 0, host)
        assert torch.equal(ring.wait_filled(0)[1], host[1])
        overlap.remove_observer(order)
    assert {s.stream for s in tl.find(name="fill")} == {overlap.DEFAULT} and order.seen == []
    assert prefetches.report().hidden_share in (0.0, None)
    ring.close()


def _ring_machinery(source):
    """The names a module uses of the ring's own machinery: the copy stream, events, `record_stream`."""
    tree = ast.parse(source)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return sorted(used & RING_NAMES)


def test_both_caches_stage_through_the_one_ring():
    """Each cache's rings are `Ring`s, and neither cache's modules touch the copy stream, events or `record_stream`
    themselves: a cache given a ring of its own again fails here."""
    with OffloadCache(2, 8, (2, 4), ring=2, name="kvring") as prefill:
        prefill.offload(0, torch.ones(8, 2, 4), torch.ones(8, 2, 4))
        assert torch.equal(prefill.get(0)[0], torch.ones(8, 2, 4))
        assert len(prefill.rings) == 2 and all(type(r) is Ring for r in prefill.rings)
    cfg = preset("tiny")
    model, prompts = build_model(cfg, seed=0), [[5, 9, 2], [3, 1, 4, 4]]
    with OffloadedKVCache(cfg.n_layers, len(prompts), 4 + 3, cfg.k_shape, cfg.v_shape) as decode:
        greedy_generate(model, prompts, 3, cache=decode, mode="two-batch")
        assert len(decode.rings) == 2 and all(type(r) is Ring for r in decode.rings)  # one per micro-batch
    for module in CACHES:
        with open(os.path.join(ROOT, module), encoding="utf-8") as f:
            assert _ring_machinery(f.read()) == [], f"{module} keeps copy-stream machinery of its own"


def test_the_machinery_check_can_fail():
    assert _ring_machinery("import overlap\nwith overlap.stream(overlap.KV_OFFLOAD):\n    pass\n") == \
        ["KV_OFFLOAD", "stream"]
    assert _ring_machinery("from overlap.events import event\nevent('x').record()\n") == ["event"]
    assert _ring_machinery("from overlap.offload import Ring\n") == []
