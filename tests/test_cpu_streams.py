"""CPU semantics of streams: side-stream collectives and copies are really asynchronous,
events order them, and overlap on or off gives the same results."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

import overlap
from overlap.multirank import run_ranks

pytestmark = pytest.mark.cpu_only


def _uneven_splits(rank, world, salt=0):
    return [(rank * 3 + d * 5 + salt) % 4 for d in range(world)]  # zeros included


def _exchange_counts(splits, group):
    send = torch.tensor(splits, dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _a2a_side_equals_sync(ctx, dtypes):
    ok = []
    for salt, dtype in enumerate(dtypes):
        splits = _uneven_splits(ctx.rank, ctx.world_size, salt)
        recv_splits = _exchange_counts(splits, ctx.group)
        g = torch.Generator().manual_seed(100 * ctx.rank + salt)
        x = torch.randn(sum(splits), 3, 5, generator=g).to(dtype)
        ref = torch.empty(sum(recv_splits), 3, 5, dtype=dtype)
        dist.all_to_all_single(ref, x, recv_splits, splits, group=ctx.group)
        out = torch.full_like(ref, float("nan"))
        ev = overlap.event("a2a_done")
        with overlap.stream(overlap.EP_COMM):
            overlap.all_to_all_single(out, x, recv_splits, splits, group=ctx.group)
            ev.record(out)
        out = ev.wait(out)
        ok.append(torch.equal(out, ref))
    return ok


@pytest.mark.parametrize("world", [1, 2, 4])
def test_uneven_all_to_all_on_side_stream_equals_sync(world):
    out = run_ranks(_a2a_side_equals_sync, world, [torch.float32, torch.float64])
    assert out == [[True, True]] * world


def _read_before_wait_is_a_real_race(ctx):
    store = dist.distributed_c10d._get_default_store()
    n = 1000
    x = torch.full((2 * n,), float(ctx.rank + 1))
    out = torch.zeros(2 * n)
    ev = overlap.event("race")
    if ctx.rank == 1:
        store.wait(["rank0_has_read"])  # rank 1 sends only after rank 0 looked too early
    with overlap.stream(overlap.EP_COMM):
        overlap.all_to_all_single(out, x, group=ctx.group)
        ev.record(out)
    early = None
    if ctx.rank == 0:
        early = out[n:].clone()  # rank 1's part: cannot have arrived yet
        store.set("rank0_has_read", "1")
    out = ev.wait(out)
    return early, out


def test_reading_a_side_stream_output_before_its_wait_sees_stale_data():
    (early, out0), (_, out1) = run_ranks(_read_before_wait_is_a_real_race, 2)
    assert torch.equal(early, torch.zeros(1000))  # stale: the collective was still in flight
    assert torch.equal(out0, torch.cat([torch.full((1000,), 1.0), torch.full((1000,), 2.0)]))
    assert torch.equal(out1, out0)


def _layer_like(ctx):
    """Compute on the main stream while an exchange runs on the side stream, then combine."""
    g = torch.Generator().manual_seed(7 + ctx.rank)
    w = torch.randn(16, 16, generator=g)
    x = torch.randn(8 * ctx.world_size, 16, generator=g)
    ev = overlap.event("layer_a2a")
    recv = torch.empty_like(x)
    with overlap.stream(overlap.EP_COMM):
        overlap.all_to_all_single(recv, x, group=ctx.group)
        ev.record(recv)
    local = torch.tanh(x @ w)  # overlaps the exchange
    recv = ev.wait(recv)
    back = torch.empty_like(recv)
    with overlap.stream(overlap.EP_COMM):
        overlap.all_to_all_single(back, recv @ w, group=ctx.group)
        ev.record(back)
    back = ev.wait(back)
    return local + back


def _on_and_off(ctx):
    with overlap.enabled(True):
        on = _layer_like(ctx)
    with overlap.enabled(False):
        off = _layer_like(ctx)
    return torch.equal(on, off)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_enable_switch_gives_identical_results(world):
    assert run_ranks(_on_and_off, world) == [True] * world


def _env_off_is_synchronous(ctx):
    assert not overlap.is_enabled()
    out = torch.zeros(2 * ctx.world_size)
    with overlap.stream(overlap.EP_COMM):
        overlap.all_to_all_single(out, torch.ones(2 * ctx.world_size), group=ctx.group)
    return bool((out == 1).all())  # no wait: with overlap off the exchange already completed


def test_env_switch_off_lowers_to_single_stream_code():
    assert run_ranks(_env_off_is_synchronous, 2, env={"OVERLAP_ENABLE": "0"}) == [True, True]


def _chained_on_one_stream(ctx):
    """Two exchanges on the same side stream, the second reading the first's output: stream order."""
    x = torch.arange(4.0 * ctx.world_size) + 100 * ctx.rank
    mid = torch.empty_like(x)
    out = torch.empty_like(x)
    ev = overlap.event("chain")
    with overlap.stream(overlap.EP_COMM):
        overlap.all_to_all_single(mid, x, group=ctx.group)
        overlap.all_to_all_single(out, mid, group=ctx.group)
        ev.record(out)
    out = ev.wait(out)
    return torch.equal(out, x)  # all_to_all twice with equal splits is the identity


def test_same_stream_launches_keep_stream_order():
    assert run_ranks(_chained_on_one_stream, 2) == [True, True]


def test_copy_runs_on_the_copy_thread_and_event_orders_it():
    src = torch.randn(256, 64)
    dst = torch.zeros_like(src)
    seen = []
    release = threading.Event()
    ev = overlap.event("copy_done")
    with overlap.stream(overlap.KV_OFFLOAD):
        overlap.issue_host("blocker", lambda: (seen.append(threading.current_thread().name), release.wait(30)))
        overlap.copy_(dst, src)
        ev.record(dst)
    assert torch.equal(dst, torch.zeros_like(src))  # queued behind the blocker on the copy thread
    release.set()
    dst = ev.wait(dst)
    assert torch.equal(dst, src)
    assert seen and seen[0] != threading.current_thread().name and "kv_offload" in seen[0]


def test_copy_on_main_stream_is_inline_and_checks_shapes():
    src = torch.randn(4, 4)
    dst = torch.zeros(4, 4)
    overlap.copy_(dst, src)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="shape"):
        overlap.copy_(torch.zeros(3), src)


def test_wait_tensor_joins_side_streams_and_synchronize_drains():
    release = threading.Event()
    done = []
    with overlap.stream("side_a"):
        overlap.issue_host("slow", lambda: (release.wait(30), done.append(1)))
    threading.Timer(0.05, release.set).start()
    x = torch.ones(2)
    assert overlap.wait_tensor(x, x) is x
    assert done == [1]
    with overlap.stream("side_a"):
        overlap.issue_host("more", lambda: done.append(2))
    overlap.synchronize()
    assert done == [1, 2]


def test_bad_split_sizes_fail_before_the_collective():
    # no process group is needed to reject them: the check runs before dist is touched
    import overlap.comm as comm

    with pytest.raises(ValueError, match="do not add up"):
        comm._check_splits("input", torch.zeros(5, 2), [1, 1], 2)
    with pytest.raises(ValueError, match="3 input split sizes for a group of 2"):
        comm._check_splits("input", torch.zeros(3, 2), [1, 1, 1], 2)
    with pytest.raises(ValueError, match="not divisible"):
        comm._check_splits("output", torch.zeros(3, 2), None, 2)


def _mismatch(ctx):
    with pytest.raises(ValueError, match="does not match"):
        overlap.all_to_all_single(torch.zeros(2, 3), torch.zeros(2, 4), group=ctx.group)
    with pytest.raises(ValueError, match="do not add up"):
        overlap.all_to_all_single(torch.zeros(2), torch.zeros(2), [1, 1], [2, 1], group=ctx.group)
    # every rank rejected locally, so this collective still lines up on all ranks
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)
    return t.item()


def test_bad_input_is_rejected_on_every_rank_without_hanging():
    assert run_ranks(_mismatch, 2, timeout=60) == [2.0, 2.0]


def _slow_link(ctx):
    overlap.set_link(overlap.Link(gbps=1000.0, latency_us=300_000))  # 0.3 s per message
    x = torch.ones(4 * ctx.world_size)
    out = torch.zeros_like(x)
    ev = overlap.event("link")
    with overlap.Timeline() as tl:
        with overlap.stream(overlap.EP_COMM):
            overlap.all_to_all_single(out, x, group=ctx.group)
            ev.record(out)
        in_flight = not all(p.done() for p in overlap.get_stream(overlap.EP_COMM).snapshot())
        out = ev.wait(out)
    (s,) = tl.find(kind="comm")
    return in_flight, s.end - s.start, torch.equal(out, x)


def test_simulated_link_delays_completion_without_blocking_the_host():
    for in_flight, seconds, ok in run_ranks(_slow_link, 2):
        assert in_flight and ok
        assert seconds >= 0.3  # a lower bound by construction (the link sleeps), not a speed claim


def test_link_parsing():
    assert overlap.parse_link("2,20") == overlap.Link(2.0, 20.0)
    assert overlap.Link(1.0).seconds(10**9) == pytest.approx(1.0)
    for bad in ("", "0", "1,2,3", "x"):
        with pytest.raises(ValueError, match="GBPS"):
            overlap.parse_link(bad)


def test_issue_ahead_runs_on_the_streams_thread_while_the_caller_goes_on():
    """`overlap.issue_ahead` on a CPU side stream: the stream's worker runs the work in the caller's context while
    the caller goes on (the work waits for the caller's signal, bounded: run in place it would time out)."""
    go = threading.Event()

    def work():
        return go.wait(10), threading.current_thread().name, overlap.current_stream_tag()

    with overlap.stream(overlap.EP_COMM):
        ahead = overlap.issue_ahead("ahead", work)
    go.set()
    signalled, thread, tag = ahead.result()
    assert signalled and thread.startswith("overlap-ep_comm") and tag == overlap.EP_COMM
    assert overlap.issue_ahead("here", work) is None  # the default stream is the caller's own thread
    with overlap.enabled(False), overlap.stream(overlap.EP_COMM):
        assert overlap.issue_ahead("off", work) is None


def test_another_threads_collective_waits_for_the_work_issued_ahead():
    """Every rank issues its collectives in one order: a collective issued after `issue_ahead` waits until the
    work run ahead (which issues collectives of its own) has returned."""
    order = []

    def work():
        time.sleep(0.3)
        order.append("ahead")

    def collective(async_op):
        order.append("collective")

    ahead = overlap.issue_ahead("ahead", work, overlap.EP_COMM)
    overlap.issue_collective("next", collective)  # on the default stream: synchronous
    ahead.result()
    assert order == ["ahead", "collective"]


def test_work_issued_ahead_is_waited_for_within_the_bound_and_its_error_comes_back():
    def fail():
        raise ValueError("bad counts")

    with pytest.raises(ValueError, match="bad counts"):
        overlap.issue_ahead("fails", fail, overlap.EP_COMM).result()
    before = overlap.wait_timeout()
    overlap.set_wait_timeout(0.2)
    try:
        slow = overlap.issue_ahead("slow", lambda: time.sleep(1.5), overlap.EP_COMM)
        with pytest.raises(overlap.WaitTimeout, match="'slow' on stream 'ep_comm'"):
            slow.result()
        with pytest.raises(overlap.WaitTimeout, match="'slow'"):
            overlap.issue_collective("next", lambda async_op: None)  # waits for it, bounded too
    finally:
        overlap.set_wait_timeout(before)
        overlap.synchronize()
