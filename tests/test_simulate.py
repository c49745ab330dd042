"""The schedule simulator on hand-built tiny schedules whose timelines are worked out by hand."""
import json

import pytest

from microbatch import (CostModel, Interconnect, Linear, OpCost, Operation, Schedule, ScheduledOp, Transfer, lower,
                        predict, serial, simulate, validate)
from microbatch.planning.simulation import cross_stream_edges, placeholder_inputs
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT
from overlap.observability.timeline import intersects


def _op(name, reads, writes, stream=DEFAULT):
    return Operation(name, lambda *a: None, tuple(reads), tuple(writes), stream)


# one layer: compute, an exchange on the comm stream, compute that reads what it received
EXCHANGE = [[_op("attn", ["hidden"], ["x"]), _op("send", ["x"], ["y"], EP_COMM), _op("fin", ["y"], ["out"])]]
INPUTS2 = [{"hidden": None}, {"hidden": None}]


def _costs(ops, latency=0.0, per_byte=0.0, overhead=0.0):
    return CostModel(ops, Interconnect(latency, per_byte), overhead)


def _schedule(*launches, orders=()):
    return Schedule("hand", tuple(ScheduledOp(*l) for l in launches), tuple(orders))


def _run(schedule, layers, tokens, costs, inputs=None, **kw):
    inputs = inputs or [{"hidden": None} for _ in tokens]
    return simulate(schedule, validate(schedule, layers, inputs), tokens, costs, **kw)


def _span(pred, name, mb, kind=None):
    found = [s for s in pred.spans if s.name == name and s.meta["mb"] == mb and (kind is None or s.kind == kind)]
    assert len(found) == 1, found
    return found[0]


def test_serial_is_the_sum_of_the_costs():
    layers = [[_op("attn", ["hidden"], ["x"]), _op("mlp", ["x"], ["out"])]] * 2
    costs = _costs({"attn": OpCost(Linear(1.0, 0.01)), "mlp": OpCost(Linear(0.5, 0.02))}, overhead=0.1)
    pred = _run(serial(layers, 1), layers, [100], costs)
    assert pred.total_s == pytest.approx(2 * (2.0 + 2.5) + 4 * 0.1)
    assert [s.name for s in pred.spans] == ["attn", "mlp"] * 2
    assert all(s.stream == DEFAULT and s.kind == "compute" and s.rank == 0 for s in pred.spans)
    # with an exchange on the main stream: synchronous on the CPU path, so it adds up too
    costs = _costs({"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)),
                    "send": OpCost(Linear(0.5), (Transfer("send", Linear(1000)),))}, latency=1.0, per_byte=1e-3)
    pred = _run(serial(EXCHANGE, 2), EXCHANGE, [10, 10], costs)
    assert pred.total_s == pytest.approx(2 * (4 + 0.5 + 2 + 1))
    assert _span(pred, "send", 0, "issue").end == pytest.approx(6.5)  # the issue waits for its transfer


def _two_batch_by_hand():
    return _schedule((0, 0, "attn"), (0, 0, "send", EP_COMM), (1, 0, "attn"), (1, 0, "send", EP_COMM),
                     (0, 0, "fin"), (1, 0, "fin"))


def test_an_exchange_hides_under_the_other_micro_batch_compute():
    costs = _costs({"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)),
                    "send": OpCost(Linear(), (Transfer("send", Linear()),))}, latency=3.0)
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs)
    # attn0 0-4; send0 4-7 under attn1 4-8; send1 8-11; fin0 8-9; fin1 waits for send1: 11-12
    comm0, attn1 = _span(pred, "send", 0, "comm"), _span(pred, "attn", 1)
    assert (comm0.start, comm0.end, attn1.start, attn1.end) == pytest.approx((4, 7, 4, 8))
    assert intersects(comm0, attn1)
    assert (_span(pred, "fin", 0).start, _span(pred, "fin", 1).start) == pytest.approx((8, 11))
    assert pred.total_s == pytest.approx(12)
    assert _run(serial(EXCHANGE, 2), EXCHANGE, [8, 8], costs).total_s == pytest.approx(16)


def test_an_asynchronous_transfer_takes_host_time_from_the_compute_it_ends_in():
    ops = {"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)), "send": OpCost(Linear(), (Transfer("send", Linear()),))}
    costs = CostModel(ops, Interconnect(3.0), async_host_s=0.5)
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs)
    # send0 4-7 ends inside attn1 (4-8): attn1 takes 0.5 more, 4-8.5; send1 8.5-11.5; fin0 8.5-9.5;
    # send1 ends while the host waits for it, which costs nothing: fin1 11.5-12.5
    assert (_span(pred, "attn", 1).start, _span(pred, "attn", 1).end) == pytest.approx((4, 8.5))
    assert _span(pred, "send", 1, "comm").end == pytest.approx(11.5)
    assert (_span(pred, "fin", 0).end, _span(pred, "fin", 1).start) == pytest.approx((9.5, 11.5))
    assert pred.total_s == pytest.approx(12.5)
    # per byte: a 1000-byte transfer adds 0.5 + 1000 * 1e-3
    per_byte = {**ops, "send": OpCost(Linear(), (Transfer("send", Linear(1000)),))}
    heavy = _run(_two_batch_by_hand(), EXCHANGE, [8, 8],
                 CostModel(per_byte, Interconnect(3.0), async_host_s=0.5, async_host_per_byte=1e-3))
    assert _span(heavy, "attn", 1).end == pytest.approx(4 + 4 + 1.5)
    # synchronous collectives (serial, on the main stream) and device semantics are not charged
    assert _run(serial(EXCHANGE, 2), EXCHANGE, [8, 8], costs).total_s == pytest.approx(16)
    plain = CostModel(ops, Interconnect(3.0))
    assert _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs, device=True).total_s == pytest.approx(
        _run(_two_batch_by_hand(), EXCHANGE, [8, 8], plain, device=True).total_s)


def test_a_busy_host_notices_an_asynchronous_completion_late():
    ops = {"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)), "send": OpCost(Linear(), (Transfer("send", Linear()),))}
    costs = CostModel(ops, Interconnect(3.0), async_notice_s=0.5)
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs)
    # send0's link time (4-7) runs out under attn1 (4-8): the host waits for it from 8 and sees it at 8.5,
    # fin0 8.5-9.5; send1 (link 8-11) is waited for from 9.5, before it runs out: fin1 11-12
    assert _span(pred, "fin", 0).start == pytest.approx(8.5)
    assert _span(pred, "fin", 1).start == pytest.approx(11) and pred.total_s == pytest.approx(12)
    # a wait that begins before the link time runs out: this host leaves the cores to gloo, but the
    # other rank may still compute: fin1 waits from 9.5 for send1 (issued 8, link 8-11), which
    # completes 1 or 5 after its issue (equally likely): the mean of max(11, 9) and max(11, 13), 12
    peer = CostModel(ops, Interconnect(3.0), async_notice_s=0.5, async_peer_s=(1.0, 5.0))
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], peer)
    assert (_span(pred, "fin", 0).start, _span(pred, "fin", 1).start) == pytest.approx((8.5, 12))
    # a longer transfer hides it: with quantiles shorter than the link time nothing changes
    hidden = CostModel(ops, Interconnect(3.0), async_notice_s=0.5, async_peer_s=(1.0, 2.0))
    assert _span(_run(_two_batch_by_hand(), EXCHANGE, [8, 8], hidden), "fin", 1).start == pytest.approx(11)
    quick = {**ops, "attn": OpCost(Linear(2))}  # attn0 0-2, send0 2-5, attn1 2-4: fin0 waits from 4
    early = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], CostModel(quick, Interconnect(3.0), async_notice_s=0.5))
    plain = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], CostModel(quick, Interconnect(3.0)))
    assert _span(early, "fin", 0).start == pytest.approx(_span(plain, "fin", 0).start) == pytest.approx(5)
    # synchronous collectives and device semantics: never
    assert _run(serial(EXCHANGE, 2), EXCHANGE, [8, 8], costs).total_s == pytest.approx(16)
    assert _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs, device=True).total_s == pytest.approx(
        _run(_two_batch_by_hand(), EXCHANGE, [8, 8], CostModel(ops, Interconnect(3.0)), device=True).total_s)


def test_issuing_an_asynchronous_collective_takes_host_time():
    ops = {"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)), "send": OpCost(Linear(), (Transfer("send", Linear(100)),))}
    costs = CostModel(ops, Interconnect(3.0), async_issue_s=0.25, async_issue_per_byte=2.5e-3)
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs)
    # attn0 0-4; issuing send0 takes the host 0.25 + 0.25 (4-4.5) while its link time runs 4-7; attn1 4.5-8.5;
    # send1 issued 8.5-9, on the link 8.5-11.5; fin0 9-10; fin1 waits for send1: 11.5-12.5
    assert (_span(pred, "send", 0, "issue").end, _span(pred, "send", 0, "comm").end) == pytest.approx((4.5, 7))
    assert (_span(pred, "attn", 1).start, _span(pred, "fin", 0).start) == pytest.approx((4.5, 9))
    assert pred.total_s == pytest.approx(12.5)
    # a synchronous collective's call is in its operation's work and the link's time already
    assert _run(serial(EXCHANGE, 2), EXCHANGE, [8, 8], costs).total_s == pytest.approx(16)


def test_a_transfers_wait_delays_its_end_but_not_the_link():
    layers = [[_op("send", ["hidden"], ["y"], EP_COMM), _op("fin", ["y"], ["out"])]]
    waited = Transfer("send", Linear(1000), wait_s=5.0)
    costs = _costs({"fin": OpCost(Linear(1)), "send": OpCost(Linear(), (waited,))}, per_byte=2e-3)
    sched = Schedule("hand", (ScheduledOp(0, 0, "send", EP_COMM), ScheduledOp(1, 0, "send", SHARED_EXPERT),
                              ScheduledOp(0, 0, "fin"), ScheduledOp(1, 0, "fin")))
    pred = _run(sched, layers, [1, 1], costs)
    c0, c1 = _span(pred, "send", 0, "comm"), _span(pred, "send", 1, "comm")
    assert (c0.end, c1.end) == pytest.approx((7, 9))  # link 0-2 then 2-4, each ends 5 later
    assert _span(pred, "fin", 0).start == pytest.approx(7)
    early = Transfer("send", Linear(1000), wait_s=-5.0)  # a negative wait never ends a transfer before it starts
    costs = _costs({"fin": OpCost(Linear(1)), "send": OpCost(Linear(), (early,))}, per_byte=2e-3)
    c1 = _span(_run(sched, layers, [1, 1], costs), "send", 1, "comm")
    assert c1.end == pytest.approx(2)  # starts at 2, when the link is free; not before
    grows = Transfer("send", Linear(1000), wait_s=1.0, wait_per_token=0.5)  # 1 + 0.5 per token of the launch
    costs = _costs({"fin": OpCost(Linear(1)), "send": OpCost(Linear(), (grows,))}, per_byte=2e-3)
    pred = _run(sched, layers, [2, 6], costs)
    assert (_span(pred, "send", 0, "comm").end, _span(pred, "send", 1, "comm").end) == pytest.approx((4, 8))


def test_two_transfers_queue_on_the_link():
    layers = [[_op("send", ["hidden"], ["y"], EP_COMM), _op("fin", ["y"], ["out"])]]
    costs = _costs({"fin": OpCost(Linear(1)), "send": OpCost(Linear(), (Transfer("send", Linear(1000)),))},
                   per_byte=2e-3)
    sched = _schedule((0, 0, "send", EP_COMM), (1, 0, "send", EP_COMM), (0, 0, "fin"), (1, 0, "fin"))
    pred = _run(sched, layers, [1, 1], costs)
    c0, c1 = _span(pred, "send", 0, "comm"), _span(pred, "send", 1, "comm")
    assert (c0.start, c0.end, c1.start, c1.end) == pytest.approx((0, 2, 0, 4))  # issued at 0, carried after c0
    assert (_span(pred, "fin", 0).start, _span(pred, "fin", 1).start) == pytest.approx((2, 4))
    assert pred.total_s == pytest.approx(5)
    # on two streams they still share the one link
    two = Schedule("hand", (sched.launches[0], ScheduledOp(1, 0, "send", SHARED_EXPERT)) + sched.launches[2:])
    assert _span(_run(two, layers, [1, 1], costs), "send", 1, "comm").end == pytest.approx(4)


def _dispatch_costs(blocking):
    counts = Transfer("dispatch.counts", Linear(0), blocking=blocking)
    payload = Transfer("dispatch", Linear(1000))
    return _costs({"attn": OpCost(Linear(3)), "dispatch": OpCost(Linear(0.5), (counts, payload)),
                   "fin": OpCost(Linear(1))}, latency=1.0, per_byte=1e-3)


def test_a_host_blocking_count_exchange_delays_later_issues():
    layers = [[_op("attn", ["hidden"], ["x"]), _op("dispatch", ["x"], ["y"], EP_COMM), _op("fin", ["y"], ["out"])]]
    sched = _schedule((0, 0, "attn"), (0, 0, "dispatch", EP_COMM), (1, 0, "attn"), (1, 0, "dispatch", EP_COMM),
                      (0, 0, "fin"), (1, 0, "fin"))
    pred = _run(sched, layers, [1, 1], _dispatch_costs(blocking=True))
    # dispatch0: host work 3-3.5, counts 3.5-4.5 (the host waits), payload issued at 4.5: 4.5-6.5
    assert _span(pred, "dispatch", 0, "issue").end == pytest.approx(4.5)
    assert _span(pred, "dispatch", 0, "comm").end == pytest.approx(6.5)
    assert _span(pred, "attn", 1).start == pytest.approx(4.5)
    free = _run(sched, layers, [1, 1], _dispatch_costs(blocking=False))
    assert _span(free, "attn", 1).start == pytest.approx(3.5)  # nothing read on the host: issued at once
    assert pred.total_s > free.total_s


def test_a_count_exchange_read_by_a_later_launch_runs_ahead_on_the_cpu_path_and_in_place_on_a_device():
    """The dispatch in two steps: ``counts`` issues the count exchange, ``dispatch`` reads it (read_at). The CPU path
    reads it and sends the tokens ahead on the comm stream's thread (`overlap.issue_ahead`); a device's host reads it
    in the reading launch's place."""
    layers = [[_op("attn", ["hidden"], ["x"]), _op("counts", ["x"], ["k"], EP_COMM),
               _op("dispatch", ["k"], ["y"], EP_COMM), _op("fin", ["y"], ["out"])]]
    sched = _schedule((0, 0, "attn"), (0, 0, "counts", EP_COMM), (1, 0, "attn"), (1, 0, "counts", EP_COMM),
                      (0, 0, "dispatch", EP_COMM), (1, 0, "dispatch", EP_COMM), (0, 0, "fin"), (1, 0, "fin"))

    def costs(read_at):
        counts = Transfer("dispatch.counts", Linear(0), blocking=True, read_at=read_at)
        return _costs({"attn": OpCost(Linear(3)), "counts": OpCost(Linear(0.5), (counts,)),
                       "dispatch": OpCost(Linear(0.5), (Transfer("dispatch", Linear(1000)),)),
                       "fin": OpCost(Linear(1))}, latency=1.0, per_byte=1e-3)

    pred = _run(sched, layers, [1, 1], costs("dispatch"))
    # counts0 3-3.5, its exchange 3.5-4.5; dispatch0 runs ahead once it returns: 4.5-5, payload 5-7 on the link.
    # attn1 3.5-7 (3 s, and the 0.5 s dispatch0 took from the cores meanwhile); counts1 7-7.5, exchange 7.5-8.5;
    # dispatch1 ahead 8.5-9, payload 9-11; the host meets dispatch0 (issued) and dispatch1 (at 9) in their places;
    # fin0 9-10, fin1 after the payload, 11-12
    assert _span(pred, "attn", 1).start == pytest.approx(3.5)
    assert _span(pred, "attn", 1).end == pytest.approx(7.0)
    assert _span(pred, "dispatch", 0, "issue").start == pytest.approx(4.5)
    assert _span(pred, "dispatch", 0, "comm").end == pytest.approx(7.0)  # not waiting for the host to reach it
    assert _span(pred, "dispatch", 1, "issue").start == pytest.approx(8.5)
    assert _span(pred, "fin", 0).start == pytest.approx(9.0)
    assert pred.total_s == pytest.approx(12.0)
    now = _run(sched, layers, [1, 1], costs(""))  # read in its own launch: the host waits right there
    assert _span(now, "attn", 1).start == pytest.approx(4.5)
    # on a device the host reads in the reading launch's place: attn1 is issued at once
    assert _span(_run(sched, layers, [1, 1], costs("dispatch"), device=True), "attn", 1).start == pytest.approx(3.0)
    assert _span(_run(sched, layers, [1, 1], costs(""), device=True), "attn", 1).start == pytest.approx(4.5)


def test_device_semantics_run_compute_off_the_host():
    layers = [[_op("a", ["hidden"], ["p"]), _op("b", ["hidden"], ["q"], SHARED_EXPERT),
               _op("c", ["p", "q"], ["out"])]]
    sched = _schedule((0, 0, "a"), (0, 0, "b", SHARED_EXPERT), (0, 0, "c"))
    costs = _costs({"a": OpCost(Linear(2)), "b": OpCost(Linear(3)), "c": OpCost(Linear(1))}, overhead=0.1)
    cpu, dev = _run(sched, layers, [1], costs), _run(sched, layers, [1], costs, device=True)
    assert cpu.total_s == pytest.approx(0.3 + 2 + 3 + 1)  # inline on the host, one after the other
    assert dev.total_s == pytest.approx(0.2 + 3 + 1)  # a and b side by side; c waits for b on its stream
    assert intersects(_span(dev, "a", 0), _span(dev, "b", 0)) and not intersects(_span(cpu, "a", 0),
                                                                                  _span(cpu, "b", 0))
    # an event wait blocks the host on the CPU path only: on a device the side stream waits, the host goes on
    layers = [[_op("send", ["hidden"], ["y"], EP_COMM), _op("post", ["y"], ["z"], SHARED_EXPERT),
               _op("attn", ["hidden"], ["x"]), _op("fin", ["x", "z"], ["out"])]]
    sched = _schedule((0, 0, "send", EP_COMM), (0, 0, "post", SHARED_EXPERT), (0, 0, "attn"), (0, 0, "fin"))
    costs = _costs({"send": OpCost(Linear(), (Transfer("send", Linear()),)), "post": OpCost(Linear(1)),
                    "attn": OpCost(Linear(4)), "fin": OpCost(Linear(1))}, latency=3.0)
    cpu, dev = _run(sched, layers, [1], costs), _run(sched, layers, [1], costs, device=True)
    assert _span(cpu, "attn", 0).start == pytest.approx(4)  # after post, which waited for the transfer until 3
    assert _span(dev, "attn", 0).start == pytest.approx(0)  # post waits on its stream; the main stream runs
    assert (cpu.total_s, dev.total_s) == pytest.approx((9, 5))


def test_a_lowering_and_its_schedule_predict_the_same():
    sched = _two_batch_by_hand()
    lowering, flow = lower(sched, EXCHANGE, INPUTS2, caller=DEFAULT)
    costs = _costs({"attn": OpCost(Linear(4)), "fin": OpCost(Linear(1)),
                    "send": OpCost(Linear(), (Transfer("send", Linear()),))}, latency=3.0)
    assert cross_stream_edges(lowering, flow) == cross_stream_edges(sched, flow) == [(), (0,), (), (2,), (1,), (3,)]
    assert simulate(lowering, flow, [8, 8], costs).total_s == simulate(sched, flow, [8, 8], costs).total_s


def test_predict_by_mode_name_and_per_layer_costs():
    layers = [[_op("attn", ["hidden", "seq"], ["x"]), _op("mlp", ["x"], ["out"])]] * 2
    assert placeholder_inputs(layers, 2) == [{"hidden": None, "seq": None}] * 2
    costs = CostModel({"attn": OpCost(Linear(1)), "mlp": OpCost(Linear(1))},
                      per_layer={(1, "mlp"): OpCost(Linear(0, 0.5))})
    assert predict("serial", layers, [10], costs).total_s == pytest.approx(1 + 1 + 1 + 5)
    with pytest.raises(KeyError, match="'mlp'"):
        predict("serial", layers, [10], CostModel({"attn": OpCost(Linear(1))}))
    two = serial(layers, 2)
    with pytest.raises(ValueError, match="2 micro-batches"):
        simulate(two, validate(two, layers, placeholder_inputs(layers, 2)), [10], costs)


def test_prediction_exports_a_chrome_trace(tmp_path):
    costs = _costs({"attn": OpCost(Linear(0.004)), "fin": OpCost(Linear(0.001)),
                    "send": OpCost(Linear(), (Transfer("send", Linear()),))}, latency=0.003)
    pred = _run(_two_batch_by_hand(), EXCHANGE, [8, 8], costs)
    data = json.load(open(pred.save_chrome_trace(str(tmp_path / "plan.json"))))
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(pred.spans) == 8
    assert {(e["name"], e["cat"], e["args"]["stream"], e["args"]["mb"], e["args"]["layer"]) for e in xs} >= {
        ("send", "comm", EP_COMM, 0, 0), ("send", "issue", EP_COMM, 1, 0), ("fin", "compute", DEFAULT, 1, 0)}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(12e3)
