"""Schedules as data: the generated launch orders and the checks that reject bad schedules."""
from collections import namedtuple

import pytest

from microbatch import (MODES, FromMicroBatch, ScheduledOp, Operation, Schedule, ScheduleError, n_batch, run,
                        schedule_for, serial, shared, two_batch, validate)
from overlap import EP_COMM, DEFAULT, SHARED_EXPERT

Stage = namedtuple("Stage", "name fn reads writes stream")  # any object with the five fields is an operation


def _f(*a):
    return a[0]


def moe_ops(prefix=""):
    """attn, gate -> dispatch, experts -> combine, shared, finalize; names optionally prefixed."""
    p = prefix
    return [
        Operation("attn", _f, ("hidden",), ("x",)),
        Operation(p + "gate", _f, ("x",), ("moe_in",)),
        Operation(p + "dispatch", _f, ("moe_in",), ("recv",), EP_COMM),
        Operation(p + "experts", _f, ("recv",), ("y",)),
        Operation(p + "combine", _f, ("y",), ("back",), EP_COMM),
        Operation(p + "shared", _f, ("moe_in",), ("sh",), SHARED_EXPERT),
        Operation(p + "finalize", _f, ("x", "back", "sh"), ("out",)),
    ]


def dense_ops():
    return [Operation("attn", _f, ("hidden",), ("x",)), Operation("mlp", _f, ("x",), ("out",))]


def _names(schedule, layer=None):
    return [f"{l.op}{l.mb}" for l in schedule.launches if layer is None or l.layer == layer]


INPUTS2 = [{"hidden": 0}, {"hidden": 1}]


def test_two_batch_follows_production_order():
    s = two_batch([moe_ops(), moe_ops()], 2)
    validate(s, [moe_ops(), moe_ops()], INPUTS2)
    assert [f"{l.op}{l.mb}" for l in s.launches[:13]] == [
        "attn0", "gate0", "dispatch0", "attn1", "gate1", "dispatch1", "shared0", "shared1",
        "experts0", "combine0", "experts1", "combine1", "finalize0"]
    # mb1's finalize is deferred into the next layer, behind mb0's attention
    assert [(l.op, l.mb, l.layer) for l in s.launches[13:16]] == [("attn", 0, 1), ("finalize", 1, 0), ("gate", 0, 1)]
    assert (s.launches[-1].op, s.launches[-1].mb, s.launches[-1].layer) == ("finalize", 1, 1)
    streams = {l.op: l.stream for l in s.launches}
    assert streams == {"attn": DEFAULT, "gate": DEFAULT, "dispatch": EP_COMM, "experts": DEFAULT, "combine": EP_COMM,
                       "shared": DEFAULT, "finalize": DEFAULT}


def test_two_batch_keeps_communication_in_schedule_order():
    s = two_batch([moe_ops(), moe_ops()], 2)
    comm = [i for i, l in enumerate(s.launches) if l.stream == EP_COMM]
    assert list(s.orders) == list(zip(comm, comm[1:]))


def test_generators_find_stages_by_stream_not_name():
    ops = moe_ops("moe_")
    s = two_batch([ops, ops], 2)
    validate(s, [ops, ops], INPUTS2)
    assert _names(s, 0)[:8] == ["attn0", "moe_gate0", "moe_dispatch0", "attn1", "moe_gate1", "moe_dispatch1",
                                "moe_shared0", "moe_shared1"]


def test_ep_stages_with_ordering_reads_validate():
    """The EP layer's shape: shared experts in three parts, one reading the dispatch output."""
    st = [Operation("attn", _f, ("hidden",), ("x",)), Operation("norm", _f, ("x",), ("moe_in",))] + [
        Stage("gate", _f, ("moe_in",), ("idx", "w"), DEFAULT),
        Stage("dispatch", _f, ("moe_in", "idx", "w"), ("disp",), EP_COMM),
        Stage("shared_gate_up", _f, ("moe_in", "idx"), ("sh_h",), SHARED_EXPERT),
        Stage("experts", _f, ("disp",), ("eo", "eb"), DEFAULT),
        Stage("shared_act", _f, ("sh_h", "disp"), ("sh_a",), SHARED_EXPERT),
        Stage("combine", _f, ("eo", "eb", "disp"), ("comb",), EP_COMM),
        Stage("shared_down", _f, ("sh_a", "moe_in", "eo"), ("sh_o",), SHARED_EXPERT),
        Stage("finalize", _f, ("comb", "sh_o"), ("moe_out",), DEFAULT),
        Operation("residual", _f, ("x", "moe_out"), ("out",))]
    layers = [st, st, st]
    for make in (serial, shared, two_batch):
        validate(make(layers, 2), layers, INPUTS2)
    s = two_batch(layers, 2)
    first = _names(s, 0)
    # shared_gate_up follows the dispatches; shared_act (reads the dispatch output) stays beside the experts
    assert first.index("shared_gate_up1") == first.index("dispatch1") + 2
    assert first.index("experts0") < first.index("shared_act0") < first.index("combine0")
    # behind mb0's attention and norm of layer 1 come mb1's shared_down, finalize, residual of layer 0
    nxt = [(l.op, l.mb, l.layer) for l in s.launches if l.layer == 0 or (l.layer == 1 and l.mb == 0)]
    i = nxt.index(("norm", 0, 1))
    assert nxt[i + 1:i + 4] == [("shared_down", 1, 0), ("finalize", 1, 0), ("residual", 1, 0)]


def test_shared_mode_puts_shared_on_its_stream_after_dispatch():
    s = shared([moe_ops()], 1)
    assert _names(s) == ["attn0", "gate0", "dispatch0", "shared0", "experts0", "combine0", "finalize0"]
    assert [l.stream for l in s.launches] == [DEFAULT, DEFAULT, EP_COMM, SHARED_EXPERT, DEFAULT, EP_COMM, DEFAULT]


def counted_ops():
    """moe_ops with the dispatch in two steps: the count exchange, then the payload that reads it on the host."""
    ops = moe_ops()
    at = [op.name for op in ops].index("dispatch")
    ops[at:at + 1] = [Operation("counts", _f, ("moe_in",), ("k",), EP_COMM),
                      Operation("dispatch", _f, ("k",), ("recv",), EP_COMM)]
    return ops


def test_two_batch_reads_the_counts_after_the_other_microbatch_is_issued():
    """mb0's count read (its payload launch) comes once mb1's attention and count exchange are issued; the shared
    experts cover mb0's payload; mb1's count read comes after mb0's experts, before mb0's combine (an event after
    it on the comm stream would otherwise wait for that combine too)."""
    layers = [counted_ops(), counted_ops()]
    s = two_batch(layers, 2)
    validate(s, layers, INPUTS2)
    assert _names(s, 0)[:14] == ["attn0", "gate0", "counts0", "attn1", "gate1", "counts1", "dispatch0", "shared0",
                                 "shared1", "experts0", "dispatch1", "combine0", "experts1", "combine1"]
    three = n_batch(layers, 3)
    validate(three, layers, [{"hidden": i} for i in range(3)])
    order = ["counts2", "dispatch0", "shared0", "shared2", "experts0", "dispatch1", "combine0", "experts1", "dispatch2",
             "combine1", "experts2", "combine2"]
    first = _names(three, 0)
    assert [first.index(n) for n in order] == sorted(first.index(n) for n in order)


def test_shared_mode_keeps_the_counts_and_payload_together_before_the_shared_experts():
    s = shared([counted_ops()], 1)
    assert _names(s) == ["attn0", "gate0", "counts0", "dispatch0", "shared0", "experts0", "combine0", "finalize0"]


def test_serial_is_all_main_layer_by_layer():
    s = serial([moe_ops(), dense_ops()], 2)
    assert {l.stream for l in s.launches} == {DEFAULT} and not s.orders
    assert [(l.layer, l.mb) for l in s.launches] == sorted((l.layer, l.mb) for l in s.launches)


def test_dense_and_moe_layers_mix():
    layers = [dense_ops(), moe_ops(), dense_ops(), moe_ops(), moe_ops()]
    for make in (serial, shared, two_batch):
        for n in (1, 2, 3):
            s = make(layers, n)
            validate(s, layers, [{"hidden": i} for i in range(n)])
            assert len(s.launches) == n * sum(len(l) for l in layers)


def test_format_lists_launches_and_intents():
    text = two_batch([moe_ops()], 2).format()
    assert "mb1 L0 dispatch @ep_comm  (after #2)" in text and text.startswith("schedule two-batch")


# ---- validation errors --------------------------------------------------------------------------

def _bad(launches, layers=None, inputs=None, orders=()):
    return validate(Schedule("bad", tuple(launches), tuple(orders)), layers or [moe_ops()], inputs or [{"hidden": 0}])


def _serial_launches(n_layers=1, mb=0):
    return [ScheduledOp(mb, li, op.name) for li in range(n_layers) for op in moe_ops()]


def test_missing_launch():
    with pytest.raises(ScheduleError, match="never launches mb0 L0 finalize"):
        _bad(_serial_launches()[:-1])


def test_duplicate_launch():
    with pytest.raises(ScheduleError, match=r"launch #7 \(mb0 L0 attn @default\) repeats launch #0"):
        _bad(_serial_launches() + [ScheduledOp(0, 0, "attn")])


def test_unknown_operation():
    with pytest.raises(ScheduleError, match="layer 0 has no operation 'atn'"):
        _bad([ScheduledOp(0, 0, "atn")])


def test_out_of_range():
    with pytest.raises(ScheduleError, match="outside 1 micro-batches x 1 layers"):
        _bad([ScheduledOp(1, 0, "attn")])


def test_read_before_write():
    ls = _serial_launches()
    ls[3], ls[4] = ls[4], ls[3]  # combine before experts
    with pytest.raises(ScheduleError, match="reads mb0's 'y' of layer 0 before it is written, which 'experts'"):
        _bad(ls)


def test_next_layer_before_previous_out():
    ls = _serial_launches(2)
    ls.insert(0, ls.pop(7))  # layer 1's attention first
    with pytest.raises(ScheduleError, match="reads mb0's 'out' of layer 0 before it is written"):
        _bad(ls, [moe_ops(), moe_ops()])


def test_missing_input():
    with pytest.raises(ScheduleError, match="reads 'hidden': no operation of layer 0 writes it"):
        _bad(_serial_launches(), inputs=[{}])


def test_write_over_input():
    with pytest.raises(ScheduleError, match="writes 'x', which is an input of mb0"):
        _bad(_serial_launches(), inputs=[{"hidden": 0, "x": 1}])


def test_bad_layers():
    with pytest.raises(ScheduleError, match="two operations named 'attn'"):
        serial([[Operation("attn", _f), Operation("attn", _f)]])
    with pytest.raises(ScheduleError, match="'a' and 'b' both write 'y'"):
        serial([[Operation("a", _f, (), ("y",)), Operation("b", _f, (), ("y",))]])
    with pytest.raises(TypeError, match="is not an operation: it lacks name, fn"):
        serial([[object()]])


def test_last_layer_without_out():
    layers = [[Operation("a", _f, ("hidden",), ("x",))]]
    with pytest.raises(ScheduleError, match="writes no 'out'"):
        validate(serial(layers), layers, [{"hidden": 0}])


def test_backward_ordering_intent():
    with pytest.raises(ScheduleError, match="ordering intent"):
        _bad(_serial_launches(), orders=[(3, 1)])


def test_cross_microbatch_reference_checks():
    with pytest.raises(ScheduleError, match="refers to micro-batch 1, which is not another"):
        _bad(_serial_launches(), inputs=[{"hidden": 0, "p": FromMicroBatch(1, "k")}])
    with pytest.raises(TypeError, match="needs the names"):
        FromMicroBatch(0)


def test_validation_reports_flow():
    layers = [moe_ops(), moe_ops()]
    flow = validate(two_batch(layers, 2), layers, INPUTS2)
    assert flow.outputs == [(0, 1, "out"), (1, 1, "out")]
    assert all(key in flow.writer for key in flow.outputs)


# ---- N micro-batches ----------------------------------------------------------------------------

def test_three_batch_issues_each_segment_for_every_microbatch_in_turn():
    layers = [moe_ops(), moe_ops()]
    s = n_batch(layers, 3)
    validate(s, layers, [{"hidden": i} for i in range(3)])
    assert s.name == "three-batch" and n_batch(layers, 4).name == "four-batch"
    assert _names(s)[:20] == [
        "attn0", "gate0", "dispatch0", "attn1", "gate1", "dispatch1", "attn2", "gate2", "dispatch2",
        "shared0", "shared1", "shared2", "experts0", "combine0", "experts1", "combine1", "experts2", "combine2",
        "finalize0", "finalize1"]
    # the last micro-batch's finalize is deferred into the next layer, behind mb0's attention
    assert [(l.op, l.mb, l.layer) for l in s.launches[20:23]] == [("attn", 0, 1), ("finalize", 2, 0), ("gate", 0, 1)]
    assert (s.launches[-1].op, s.launches[-1].mb, s.launches[-1].layer) == ("finalize", 2, 1)
    assert {l.op: l.stream for l in s.launches} == {
        "attn": DEFAULT, "gate": DEFAULT, "dispatch": EP_COMM, "experts": DEFAULT, "combine": EP_COMM,
        "shared": DEFAULT, "finalize": DEFAULT}
    comm = [i for i, l in enumerate(s.launches) if l.stream == EP_COMM]
    assert list(s.orders) == list(zip(comm, comm[1:]))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_exchange_is_issued_between_other_microbatches_compute(n):
    """Between a micro-batch's exchange and the compute that reads it, another micro-batch computes."""
    layers = [dense_ops(), moe_ops(), moe_ops()]
    s = n_batch(layers, n)
    validate(s, layers, [{"hidden": i} for i in range(n)])
    for i, l in enumerate(s.launches):
        if l.stream != EP_COMM:
            continue
        reader = next(j for j, m in enumerate(s.launches) if j > i and m.mb == l.mb and m.stream == DEFAULT)
        assert any(m.mb != l.mb and m.stream == DEFAULT for m in s.launches[i + 1:reader]), (l, s.format())


def test_two_batch_is_n_batch_for_two():
    layers = [dense_ops(), moe_ops(), moe_ops()]
    for n in (1, 2, 3):
        assert two_batch(layers, n).launches == n_batch(layers, n).launches
    assert two_batch(layers, 3).name == "two-batch" and n_batch(layers, 2).name == "two-batch"


def test_n_batch_modes_are_registered_and_opt_in():
    assert {name: (m.micro_batches, m.in_all) for name, m in MODES.items()} == {
        "serial": (1, True), "shared": (1, True), "two-batch": (2, True), "three-batch": (3, False),
        "four-batch": (4, False)}
    layers = [moe_ops()]
    for name in ("three-batch", "four-batch"):
        assert schedule_for(name, layers, MODES[name].micro_batches).name == name
    assert schedule_for("three-batch", layers, 2).name == "two-batch"  # fewer parts agreed: the schedule says so


def test_an_input_may_read_several_microbatches():
    layers = [[Operation("attn", lambda h, p: h + p, ("hidden", "prefix"), ("x",)),
               Operation("mlp", _f, ("x",), ("out",))]]
    inputs = [{"hidden": 1, "prefix": 0}, {"hidden": 10, "prefix": 0},
              {"hidden": 100, "prefix": FromMicroBatch((0, 1), "x", fn=lambda a, b: a * 1000 + b)}]
    flow = validate(n_batch(layers, 3), layers, inputs)
    read = flow.reads[[i for i, l in enumerate(n_batch(layers, 3).launches) if (l.mb, l.op) == (2, "attn")][0]]
    assert read[1].keys == ((0, 0, "x"), (1, 0, "x"))
    assert run(n_batch(layers, 3), layers, inputs) == [1, 10, 100 + 1 * 1000 + 10]
    assert FromMicroBatch([0, 1], "k", "v").mbs == (0, 1) and FromMicroBatch(1, "k").mbs == (1,)
    with pytest.raises(ScheduleError, match="refers to micro-batch 2, which is not another"):
        validate(serial(layers, 3), layers, inputs[:2] + [{"hidden": 0, "prefix": FromMicroBatch((0, 2), "x")}])
    with pytest.raises(TypeError, match="at least one micro-batch"):
        FromMicroBatch((), "x")
