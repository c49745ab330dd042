"""The simulated link's rules on real gloo ranks (`overlap.link`, the CPU backend).

A slow link (1e-3 GB/s: about 1 ms per KB) makes every transfer tens of milliseconds. The link's
bookings and the bytes each collective is charged are recorded exactly; times are only checked
from below (the link sleeps at least what it charges) and for order, never for speed.
"""
import threading
import time

import pytest
import torch

import overlap
from overlap import EP_COMM, Timeline
from overlap import link as link_mod
from overlap.backends import cpu as cpu_backend
from overlap.multirank import run_ranks

pytestmark = [pytest.mark.cpu_only, pytest.mark.spawns_ranks]

SLOW = overlap.Link(gbps=1e-3)
LATENT = overlap.Link(gbps=1000.0, latency_us=40_000)  # 40 ms per transfer, the bytes next to nothing
COLS = 64
ROW = COLS * 4  # float32 bytes per row
ROWS = 160  # rows a rank sends each other rank: 40 KB, 41 ms over SLOW
EPS = 2e-3  # slack for the sleep's and the clock's granularity


def _a2a(ctx, rows, name, out_splits=None, in_splits=None):
    """All-to-all of ``rows`` rows (or the given splits) from this rank; returns (output, input)."""
    n = sum(in_splits) if in_splits else rows * ctx.world_size
    x = torch.arange(n * COLS, dtype=torch.float32).reshape(n, COLS) + 1e6 * ctx.rank
    out = torch.empty(sum(out_splits) if out_splits else n, COLS)
    overlap.all_to_all_single(out, x, out_splits, in_splits, group=ctx.group, name=name)
    return out, x


def _async(ctx, rows, name, **kw):
    """Issue on the comm stream; returns a function that waits for it."""
    ev = overlap.event(f"link_rules_{name}")
    with overlap.stream(EP_COMM):
        out, _ = _a2a(ctx, rows, name, **kw)
        ev.record(out)
    return lambda: ev.wait(out)


def _sync_once(ctx):
    _a2a(ctx, ROWS, "sync")


def _async_once(ctx):
    _async(ctx, ROWS, "async")()


def _two_in_flight(ctx):
    first, second = _async(ctx, ROWS, "first"), _async(ctx, ROWS, "second")
    first()
    second()


def _async_then_sync(ctx):
    pending = _async(ctx, ROWS, "async")
    _a2a(ctx, ROWS, "sync")  # on the default stream, while the first is in flight
    pending()


def _latency(ctx):
    first, second = _async(ctx, 1, "first"), _async(ctx, 1, "second")
    first()
    second()
    _a2a(ctx, 1, "sync")


# rank 0 keeps 50 rows and sends 3, rank 1 keeps 70 and sends 1
_IN = {0: [50, 3], 1: [1, 70]}
_OUT = {0: [50, 1], 1: [3, 70]}


def _uneven(ctx):
    pending = _async(ctx, 0, "uneven", out_splits=_OUT[ctx.rank], in_splits=_IN[ctx.rank])
    pending()


def _busy_host(ctx):
    """The host is elsewhere until long after the booking's end: the transfer still ends with its booking."""
    pending = _async(ctx, ROWS, "busy")
    time.sleep(3 * SLOW.seconds(ROWS * ROW))  # a sleep, not a spin: gloo's threads get the cores to deliver
    pending()


def _late_peer(ctx):
    """Rank 1 issues well after its booking would have ended on rank 0: rank 0 waits for its bytes."""
    if ctx.rank == 1:
        time.sleep(3 * LATENT.seconds(ROW))
    _async(ctx, 1, "late")()


SCENARIOS = {"sync": (SLOW, _sync_once), "async": (SLOW, _async_once), "two": (SLOW, _two_in_flight),
             "async_sync": (SLOW, _async_then_sync), "latency": (LATENT, _latency), "uneven": (SLOW, _uneven),
             "busy": (SLOW, _busy_host), "late": (LATENT, _late_peer)}


def _rank(ctx):
    """Every scenario on this rank: its comm spans, the link's bookings and the bytes charged."""
    overlap.set_path("cpu")
    bookings, charged = [], []
    reserve, transfer_seconds = cpu_backend.reserve, cpu_backend.transfer_seconds

    def booked(seconds):
        end = reserve(seconds)
        bookings.append((seconds, end))
        return end

    def charge(link, nbytes):
        charged.append(nbytes)
        return transfer_seconds(link, nbytes)

    cpu_backend.reserve, cpu_backend.transfer_seconds = booked, charge
    try:
        results = {}
        for key, (link, body) in SCENARIOS.items():
            overlap.set_link(link)
            torch.distributed.barrier(group=ctx.group)
            bookings.clear()
            charged.clear()
            with Timeline() as tl:
                body(ctx)
            overlap.synchronize()
            spans = {s.name: (s.start, s.end) for s in tl.find(kind="comm")}
            results[key] = dict(spans=spans, bookings=sorted(bookings, key=lambda b: b[1]), charged=list(charged),
                                offset=tl._offset)  # the spans' wall clock minus the bookings' perf_counter
        return results
    finally:
        cpu_backend.reserve, cpu_backend.transfer_seconds = reserve, transfer_seconds
        overlap.set_link(None)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank, 2, timeout=120)


def _extent(spans):
    return max(e for _, e in spans.values()) - min(s for s, _ in spans.values())


def test_sync_and_async_transfers_of_the_same_bytes_are_charged_the_same(ranks):
    d = SLOW.seconds(ROWS * ROW)
    for res in ranks:
        sync, asyn = res["sync"], res["async"]
        assert sync["charged"] == asyn["charged"] == [ROWS * ROW]
        assert [s for s, _ in sync["bookings"]] == [s for s, _ in asyn["bookings"]] == [pytest.approx(d, rel=1e-9)]
        (s0, e0), (s1, e1) = sync["spans"]["sync"], asyn["spans"]["async"]
        assert e0 - s0 >= d - EPS and e1 - s1 >= d - EPS  # at least what the link charged, either way


def test_two_transfers_in_flight_share_the_link(ranks):
    d = SLOW.seconds(ROWS * ROW)
    for res in ranks:
        for key in ("two", "async_sync"):  # two on the comm stream; one there and one synchronous
            r = res[key]
            (d0, end0), (d1, end1) = r["bookings"]
            assert d0 == pytest.approx(d, rel=1e-9) and d1 == pytest.approx(d, rel=1e-9)
            assert end1 - end0 >= d1 * (1 - 1e-9), key  # booked after the first, not beside it
            assert _extent(r["spans"]) >= 2 * d - EPS, key  # both transfers' time, one after the other
            assert all(e - s >= d - EPS for s, e in r["spans"].values()), key


def test_latency_is_charged_per_transfer(ranks):
    per = LATENT.seconds(ROW)  # one row each way: the latency and next to no bytes
    for res in ranks:
        r = res["latency"]
        assert r["charged"] == [ROW] * 3
        assert [s for s, _ in r["bookings"]] == [pytest.approx(per, rel=1e-9)] * 3
        assert per >= 0.04
        (_, a), (_, b), (_, c) = r["bookings"]
        assert b - a >= per * (1 - 1e-9) and c - b >= per * (1 - 1e-9)
        assert _extent(r["spans"]) >= 3 * per - EPS
        assert all(e - s >= per - EPS for s, e in r["spans"].values())


def test_a_transfer_is_charged_the_bytes_exchanged_with_other_ranks(ranks):
    for res in ranks:
        # even splits: ROWS rows to the other rank and ROWS from it, this rank's own ROWS stay home
        assert res["sync"]["charged"] == [ROWS * ROW]
        # uneven: 3 rows one way and 1 the other (the link is duplex: the larger direction), own rows excluded
        r = res["uneven"]
        assert r["charged"] == [3 * ROW]
        (s, e), = r["spans"].values()
        assert e - s >= SLOW.seconds(3 * ROW) - EPS


def test_a_transfer_ends_with_its_booking_however_late_the_host_looks(ranks):
    for res in ranks:
        r = res["busy"]
        (_, until), = r["bookings"]
        (start, end), = r["spans"].values()
        assert end - r["offset"] == pytest.approx(until, abs=1e-6)  # not the host's wait three transfers later
        assert start - r["offset"] <= until - SLOW.seconds(ROWS * ROW)  # booked when issued, not on arrival


def test_a_transfer_waits_for_a_late_peer_beyond_its_booking(ranks):
    per = LATENT.seconds(ROW)
    r = ranks[0]["late"]
    (_, until), = r["bookings"]
    (start, end), = r["spans"].values()
    assert end - r["offset"] > until  # the bytes arrived after the booking ended: completion is their arrival
    (peer_start, _), = ranks[1]["late"]["spans"].values()  # one wall clock: the ranks share the host
    assert end >= peer_start  # not before the peer issued (it started 3 transfers late, less the ranks' skew)
    assert end - start > per


def _many_in_flight(ctx):
    """Twenty exchanges in flight at once, each arriving before its booking ends, observed (a timeline: their
    completions' times come from the clock): one clock completes them all."""
    overlap.set_link(LATENT)
    before = threading.active_count()
    with Timeline():
        waits = [_async(ctx, 1, f"many{i}") for i in range(20)]
        time.sleep(0.1)  # the bytes arrive at once; the bookings queue on the link until 20 x 40 ms
        during = threading.active_count()
        for w in waits:
            w()
    return during - before


def test_in_flight_transfers_share_one_clock_thread():
    for extra in run_ranks(_many_in_flight, 2, timeout=60):
        # gloo's and the comm stream's own threads aside, no thread per transfer (there were 20 timers)
        assert extra <= 3, extra


def _noticed_by_the_waiter(ctx):
    """An exchange over the slow link with nobody observing, then with a timeline: the link's clock calls each time,
    and how long the unobserved wait took."""
    overlap.set_link(SLOW)
    calls = []
    at = link_mod._CLOCK.at
    link_mod._CLOCK.at = lambda when, fn: (calls.append(when), at(when, fn))[1]
    try:
        start = time.perf_counter()
        _async(ctx, ROWS, "quiet")()
        took = time.perf_counter() - start
        quiet = len(calls)
        with Timeline() as tl:
            _async(ctx, ROWS, "observed")()
        (span,) = tl.find(name="observed", kind="comm")
    finally:
        link_mod._CLOCK.at = at
    return quiet, took, len(calls) - quiet, span.end - span.start


def test_with_nobody_observing_a_transfer_completes_where_it_is_waited_with_no_callback():
    """No Python runs on gloo's or the clock's thread for an unobserved exchange (it would take the interpreter from the
    computing thread); the wait still lasts the link's time. Observed, the clock ends its span at the booking's end."""
    per = link_mod.transfer_seconds(SLOW, ROWS * ROW)
    for quiet, took, observed, length in run_ranks(_noticed_by_the_waiter, 2, timeout=60):
        assert quiet == 0 and took >= per - EPS, (quiet, took, per)
        assert observed == 1 and length >= per - EPS, (observed, length)


def test_the_clock_runs_callbacks_in_time_order_and_survives_a_failure():
    clock = link_mod._Clock()
    ran, done = [], threading.Event()
    now = time.perf_counter()

    def boom():
        raise RuntimeError("a completion failed")

    for delay, tag in ((0.06, "c"), (0.02, "a"), (0.04, "b")):
        clock.at(now + delay, lambda tag=tag: ran.append(tag))
    clock.at(now + 0.03, boom)
    clock.at(now + 0.08, done.set)
    clock.at(now - 1.0, lambda: ran.append("past"))  # already due: at once
    assert done.wait(5.0), "the clock stopped"
    assert ran == ["past", "a", "b", "c"] and clock.pending() == 0
    assert time.perf_counter() - now >= 0.08  # not before its time (a lower bound, not a speed claim)
