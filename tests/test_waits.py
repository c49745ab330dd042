"""Every wait of the CPU path is bounded: past `overlap.wait_timeout()` it raises `WaitTimeout`
naming what it waited for, and a simulated link too slow for the bound is refused when issued."""
import math
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import overlap
from overlap import link as link_mod
from overlap.multirank import run_ranks
from overlap.state import STATE

pytestmark = pytest.mark.cpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RETURNED = 5.0  # a generous bound on "it returned" (the waits under test take 0.5 s or nothing)


def test_wait_bound_is_set_checked_and_reset():
    assert overlap.wait_timeout() == 300.0
    overlap.set_wait_timeout(12)
    assert overlap.wait_timeout() == 12.0
    overlap.set_wait_timeout(None)
    assert overlap.wait_timeout() == 300.0
    for bad in (0, -1, float("nan"), float("inf"), 1e30):
        with pytest.raises(ValueError, match="wait bound"):
            overlap.set_wait_timeout(bad)
    assert overlap.wait_timeout() == 300.0
    overlap.set_wait_timeout(0.5)
    overlap.reset()
    assert overlap.wait_timeout() == 300.0
    assert issubclass(overlap.WaitTimeout, RuntimeError)
    assert {"WaitTimeout", "set_wait_timeout", "wait_timeout"} <= set(overlap.__all__)


def test_link_rejects_non_finite_and_out_of_range_values(monkeypatch):
    for text in ("1,inf", "1,nan", "inf", "nan", "1e999", "2,1e999", "0", "-1", "1,-5"):
        with pytest.raises(ValueError, match=re.escape("--cpu-link: expected 'GBPS[,LATENCY_US]'") + ".*"
                           + re.escape(repr(text))):
            overlap.parse_link(text, "--cpu-link")
    monkeypatch.setenv("OVERLAP_CPU_LINK", "1,inf")
    with pytest.raises(ValueError, match="OVERLAP_CPU_LINK: expected .*'1,inf'"):
        overlap.current_link()


def test_link_constructor_rejects_non_finite_values():
    for gbps, latency_us in ((math.inf, 0), (math.nan, 0), (1, math.inf), (1, math.nan), (0, 0), (1, -1)):
        with pytest.raises(ValueError, match="finite"):
            overlap.Link(gbps, latency_us)


def test_link_booking_rejects_values_that_would_overflow():
    before = STATE.link_busy_until
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="booking"):
            link_mod.reserve(bad)
    assert STATE.link_busy_until == before  # nothing booked
    with pytest.raises(overlap.WaitTimeout, match="wait bound"):  # longer than the bound: refused, not booked
        link_mod.reserve(1e308)
    assert STATE.link_busy_until == before
    STATE.link_busy_until = 1e308
    try:
        with pytest.raises(ValueError, match="out of range"):
            link_mod.reserve(1e308)
        assert STATE.link_busy_until == 1e308
    finally:
        STATE.link_busy_until = before


@pytest.mark.parametrize("side_stream", [False, True], ids=["main", "side"])
def test_a_transfer_longer_than_the_bound_is_refused_before_it_is_issued(side_stream):
    overlap.set_wait_timeout(10)
    overlap.set_link(overlap.Link(1e-9))
    issued = []

    def issue(async_op):
        issued.append(async_op)
        raise AssertionError("the collective was issued")

    start = time.monotonic()
    with pytest.raises(overlap.WaitTimeout) as info, overlap.Timeline() as tl:
        with overlap.stream(overlap.EP_COMM, enabled=side_stream):
            overlap.issue_collective("dispatch", issue, nbytes=320 * 1024)
    assert time.monotonic() - start < RETURNED
    assert issued == []
    assert [s.name for s in tl.spans] == ["dispatch"]  # its span closed, not left open for ever
    assert str(info.value) == ("the simulated link 1e-09 GB/s needs 3.3e+05 s for this 320 KiB transfer, more than "
                               "the 10 s wait bound: use a faster --cpu-link (overlap.set_link), or raise the wait "
                               "bound")
    assert overlap.get_stream(overlap.EP_COMM).snapshot() == []  # nothing left pending either


def _too_slow_link(ctx):
    overlap.set_wait_timeout(10)
    overlap.set_link(overlap.Link(1e-9))
    x = torch.ones(2 * 40960)  # each rank sends half of it, 160 KiB
    out = torch.zeros_like(x)
    messages = []
    start = time.monotonic()
    for side in (False, True):
        try:
            with overlap.stream(overlap.EP_COMM, enabled=side):
                overlap.all_to_all_single(out, x, group=ctx.group, name="dispatch")
        except overlap.WaitTimeout as exc:
            messages.append(str(exc))
    elapsed = time.monotonic() - start
    overlap.set_link(None)
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)  # every rank refused it before issuing: still in step
    return messages, elapsed, t.item()


def test_a_too_slow_link_fails_every_rank_at_once_and_keeps_them_in_step():
    for messages, elapsed, total in run_ranks(_too_slow_link, 2, timeout=60):
        assert len(messages) == 2 and all("160 KiB transfer, more than the 10 s wait bound" in m for m in messages)
        assert elapsed < RETURNED
        assert total == 2.0


@pytest.mark.timeout(60)  # without a bound these waits never return
def test_a_copy_that_never_finishes_makes_the_waits_raise():
    overlap.set_wait_timeout(0.5)
    release = threading.Event()
    src, dst = torch.randn(64), torch.zeros(64)
    ev = overlap.event("offloaded")
    try:
        with overlap.stream(overlap.KV_OFFLOAD):
            overlap.issue_host("stuck_copy", release.wait)
            overlap.copy_(dst, src)
            ev.record(dst)
        for wait in (lambda: ev.wait(dst), ev.synchronize, overlap.synchronize):
            start = time.monotonic()
            with pytest.raises(overlap.WaitTimeout, match=r"waited 0\.5 s for 'stuck_copy' on stream 'kv_offload' "
                                                          r"\(host work\).*overlap\.set_wait_timeout"):
                wait()
            assert time.monotonic() - start < RETURNED
    finally:
        release.set()
    overlap.set_wait_timeout(None)
    assert torch.equal(ev.wait(dst), src)  # the work completes once released, and the wait sees it


def _peer_late(ctx):
    """Rank 1 joins each exchange only after rank 0 gave up waiting for it: rank 0's waits must end."""
    store = dist.distributed_c10d._get_default_store()
    timed_out = []
    for rnd, link in enumerate((None, overlap.Link(1000.0))):  # plain gloo work, then a link's DelayedWork
        overlap.set_link(link)
        x = torch.arange(4.0 * ctx.world_size) + 10 * ctx.rank
        y = torch.zeros_like(x)
        ev = overlap.event(f"late{rnd}")
        if ctx.rank == 1:
            store.wait([f"rank0_gave_up{rnd}"])
        with overlap.stream(overlap.EP_COMM):
            overlap.all_to_all_single(y, x, group=ctx.group, name="dispatch")
            ev.record(y)
        if ctx.rank == 0:
            overlap.set_wait_timeout(0.5)
            for wait in (lambda: ev.wait(y), overlap.synchronize):
                start = time.monotonic()
                try:
                    wait()
                except overlap.WaitTimeout as exc:
                    timed_out.append((str(exc), time.monotonic() - start))
            overlap.set_wait_timeout(None)
            store.set(f"rank0_gave_up{rnd}", "1")
        y = ev.wait(y)
        assert torch.equal(y, torch.cat([x[:4] * 0 + torch.arange(4.0) + 4 * ctx.rank + 10 * r
                                         for r in range(ctx.world_size)]))
    timed_out.extend(_late_on_the_current_stream(ctx, store))
    return timed_out


def _late_on_the_current_stream(ctx, store):
    """The same on the current (synchronous) stream, as a decode step issues its exchange: the collective itself
    returns within the bound, raising (before: gloo's own wait, the group's 30-minute timeout)."""
    x = torch.arange(2.0 * ctx.world_size)
    y = torch.zeros_like(x)
    if ctx.rank == 1:
        store.wait(["rank0_gave_up_current"])
        overlap.all_to_all_single(y, x, group=ctx.group, name="exchange")
        return []
    overlap.set_wait_timeout(0.5)
    start = time.monotonic()
    try:
        overlap.all_to_all_single(y, x, group=ctx.group, name="exchange")
        return []
    except overlap.WaitTimeout as exc:
        return [(str(exc), time.monotonic() - start)]
    finally:
        overlap.set_wait_timeout(None)
        store.set("rank0_gave_up_current", "1")


def test_a_collective_a_peer_never_joins_makes_the_waits_raise():
    timed_out, nothing = run_ranks(_peer_late, 2, timeout=60)
    assert nothing == []
    assert len(timed_out) == 5  # two waits in each side stream's round, the collective itself on the current one
    for message, seconds in timed_out[:4]:
        assert message.startswith("waited 0.5 s for 'dispatch' on stream 'ep_comm' (a collective)")
    assert timed_out[4][0].startswith("waited 0.5 s for 'exchange' on stream 'default' (a collective)")
    for message, seconds in timed_out:
        assert "another rank may have failed" in message and "set_wait_timeout" in message
        assert seconds < RETURNED


_UNCAUGHT = """
import sys, time, torch, torch.distributed as dist, overlap
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(120)  # alive, never joining: the collective stays in flight on rank 0
overlap.set_wait_timeout(1)
overlap.all_to_all_single(torch.zeros(2), torch.ones(2), name="exchange")
"""


@pytest.mark.spawns_ranks
@pytest.mark.timeout(90)
def test_an_uncaught_wait_timeout_ends_the_program_with_the_collective_in_flight(tmp_path):
    """A program that catches nothing leaves with status 1 after its traceback; the interpreter's teardown does not
    wait for the collective given up on (before: gloo's wait, the group's 30-minute timeout)."""
    from support.ports import free_port

    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, "-c", _UNCAUGHT], env=dict(env, RANK=str(r)), stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for r in (0, 1)]
    try:
        _, err = ranks[0].communicate(timeout=60)
    finally:
        for rank in ranks:
            rank.kill()
        ranks[1].communicate()
    assert ranks[0].returncode == 1, err[-3000:]
    assert "WaitTimeout: waited 1 s for 'exchange' on stream 'default' (a collective)" in err, err[-3000:]
