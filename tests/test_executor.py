"""The pipeline executor on toy layers built from the overlap primitives (CPU, 1 / 2 / 4 gloo ranks)."""
import sys
import time
import types

import pytest
import torch

import overlap
from overlap.state import STATE
from microbatch import (FromMicroBatch, ScheduledOp, Operation, Schedule, ScheduleError, event_tag, lower,
                        lower_ahead, run, serial, shared, two_batch)
from overlap.multirank import run_ranks
from support.layers import weightless_layer

pytestmark = pytest.mark.cpu_only

H = 8
SCHEDULES = {"serial": serial, "shared": shared, "two_batch": two_batch}


@pytest.fixture(autouse=True)
def _on_main_stream():
    """Run each test from the main stream, whatever an earlier test in this process left behind."""
    with overlap.stream(overlap.DEFAULT):
        yield


def _weights(layer, n=3):
    g = torch.Generator().manual_seed(1000 + layer)
    return [torch.randn(H, H, generator=g) / H ** 0.5 for _ in range(n)]


def _a2a(group):
    def exchange(x):
        out = torch.empty_like(x)
        overlap.all_to_all_single(out, x, group=group, name="a2a")
        return out
    return exchange


def _slow(delay):
    """A local 'exchange' on the current stream's worker (asynchronous on a CPU side stream), slowed down."""
    def exchange(x):
        out = torch.zeros_like(x)

        def work():
            time.sleep(delay)
            out.copy_(x.flip(0) * 2)
        overlap.issue_host("slow_exchange", work, reads=(x,), writes=(out,), kind="comm")
        return out
    return exchange


def moe_layer(layer, exchange, kv=None):
    """attn, gate -> dispatch (EP_COMM), experts -> combine (EP_COMM), shared (SHARED_EXPERT), finalize.

    With ``kv`` (an exchange), a first op on the KV_OFFLOAD stream writes ``"k"`` and attention also reads
    ``"k"`` and ``"prefix"`` (another micro-batch's ``"k"``, or None).
    """
    wa, we, ws = _weights(layer)
    ops = []
    if kv is not None:
        ops.append(Operation("kv", kv, ("hidden",), ("k",), overlap.KV_OFFLOAD))

        def attn(h, k, prefix):
            extra = k.sum(0) + (prefix.sum(0) if prefix is not None else 0)
            return torch.tanh(h @ wa) + h + 0.1 * extra
        ops.append(Operation("attn", attn, ("hidden", "k", "prefix"), ("x",)))
    else:
        ops.append(Operation("attn", lambda h: torch.tanh(h @ wa) + h, ("hidden",), ("x",)))
    ops += [
        Operation("gate", lambda x: x * 0.5 + 0.1, ("x",), ("moe_in",)),
        Operation("dispatch", exchange, ("moe_in",), ("recv",), overlap.EP_COMM),
        Operation("experts", lambda r: torch.relu(r @ we), ("recv",), ("y",)),
        Operation("combine", exchange, ("y",), ("back",), overlap.EP_COMM),
        Operation("shared", lambda m: m @ ws, ("moe_in",), ("sh",), overlap.SHARED_EXPERT),
        Operation("finalize", lambda x, b, s: x + b + s, ("x", "back", "sh"), ("out",)),
    ]
    return ops


def _inputs(rank, n_micro=2, rows=4):
    g = torch.Generator().manual_seed(7 + rank)
    return [{"hidden": torch.randn(rows, H, generator=g)} for _ in range(n_micro)]


def _run_all(layers, inputs):
    return {name: run(make(layers, len(inputs)), layers, inputs) for name, make in SCHEDULES.items()}


def _assert_bitwise(results):
    ref = results["serial"]
    for name, outs in results.items():
        assert len(outs) == len(ref)
        for a, b in zip(outs, ref):
            assert torch.equal(a, b), f"{name} differs from serial"


# ---- multi-rank: overlapped schedules equal serial bitwise -------------------------------------------

def _body_equal(ctx, n_layers):
    from overlap.observability.timeline import Timeline

    layers = [moe_layer(i, _a2a(ctx.group)) for i in range(n_layers)]
    inputs = _inputs(ctx.rank, rows=2 * ctx.world_size)
    results = {}
    for name, make in SCHEDULES.items():
        with Timeline() as tl:
            results[name] = run(make(layers, 2), layers, inputs)
        comm = tl.find(name="a2a", kind="comm")
        assert len(comm) == 2 * 2 * n_layers, name
        assert all("mb" in s.meta and "layer" in s.meta for s in comm), "comm spans lack mb/layer meta"
        if name != "serial":
            assert {s.stream for s in comm} == {overlap.EP_COMM}
    overlap.synchronize()
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_overlapped_schedules_equal_serial(world):
    per_rank = run_ranks(_body_equal, world, 2, timeout=120)
    for results in per_rank:
        _assert_bitwise(results)
    if world > 1:  # the exchange really mixed the ranks: rank 0's result depends on rank 1's input
        assert not torch.equal(per_rank[0]["serial"][0], per_rank[1]["serial"][0])


# ---- the wait is never forgotten ------------------------------------------------------------------

def _slow_layers(n_layers, delay=0.03, kv=False):
    ex = _slow(delay)
    return [moe_layer(i, ex, kv=ex if kv else None) for i in range(n_layers)]


def test_slow_side_stream_is_waited_for():
    layers = _slow_layers(2)
    _assert_bitwise(_run_all(layers, _inputs(0)))


def test_without_the_executors_waits_results_break(monkeypatch):
    """Negative control: the executor is right because of its waits, not by luck of timing."""
    layers = _slow_layers(2, delay=0.1)
    inputs = _inputs(0)
    ref = run(serial(layers, 2), layers, inputs)
    monkeypatch.setattr(overlap.Event, "wait", lambda self, *c: None)
    try:
        broken = run(two_batch(layers, 2), layers, inputs)
    finally:
        overlap.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(broken, ref))


def test_sanitizer_sees_no_race_in_two_batch():
    from overlap.observability.sanitizer import Sanitizer

    layers = _slow_layers(2, delay=0.01, kv=True)
    inputs = _inputs(0)
    inputs[0]["prefix"] = None
    inputs[1]["prefix"] = FromMicroBatch(0, "k", fn=lambda k: k[:2])
    with Sanitizer(raise_on_race=True) as san:
        run(two_batch(layers, 2), layers, inputs)
        overlap.synchronize()
    assert not san.races


def test_every_cross_stream_read_has_a_wait_in_the_lowering():
    layers = _slow_layers(3)
    inputs = _inputs(0)
    for make in (shared, two_batch):
        lowering, flow = lower(make(layers, 2), layers, inputs)
        waited = {}  # (consumer stream, producer stream) -> latest producer index covered
        recorded = {s.record: s.index for s in lowering.steps if s.record}
        for step in lowering.steps:
            for tag in step.waits:
                producer = lowering.steps[recorded[tag]].scheduled.stream
                waited[step.scheduled.stream, producer] = max(waited.get((step.scheduled.stream, producer), -1),
                                                           recorded[tag])
            for r in flow.reads[step.index]:
                for key in r.keys:
                    w = flow.writer.get(key)
                    if w is not None and lowering.steps[w].scheduled.stream != step.scheduled.stream:
                        assert waited.get((step.scheduled.stream, lowering.steps[w].scheduled.stream), -1) >= w, \
                            f"{step.scheduled} reads {key} from #{w} without a wait"


# ---- cross-micro-batch values --------------------------------------------------------------------

def test_cross_microbatch_read_waits_for_the_other_microbatch():
    layers = _slow_layers(2, delay=0.03, kv=True)
    inputs = _inputs(0)
    inputs[0]["prefix"] = None
    inputs[1]["prefix"] = FromMicroBatch(0, "k", fn=lambda k: k[:2])
    results = _run_all(layers, inputs)
    _assert_bitwise(results)
    lowering, _ = lower(two_batch(layers, 2), layers, inputs)
    attn1 = [s for s in lowering.steps if s.scheduled.mb == 1 and s.scheduled.op == "attn"]
    # a wait on the offload stream recorded after mb1's own kv, which also covers mb0's earlier kv
    assert all(any(t.endswith("@kv_offload") for t in s.waits) for s in attn1)


def test_cross_microbatch_read_before_write_is_rejected():
    layers = _slow_layers(1, kv=True)
    inputs = _inputs(0)
    inputs[0]["prefix"] = None
    inputs[1]["prefix"] = FromMicroBatch(0, "k")
    names = [op.name for op in layers[0]]
    launches = [ScheduledOp(1, 0, n) for n in names] + [ScheduledOp(0, 0, n) for n in names]
    with pytest.raises(ScheduleError, match="mb0's 'k' of layer 0 before it is written"):
        run(Schedule("bad", tuple(launches)), layers, inputs)


# ---- events are created once -------------------------------------------------------------------

class _EventLog:
    def __init__(self):
        self.records, self.waits = [], []

    def on_event_record(self, name, stream):
        self.records.append((name, stream))

    def on_event_wait(self, name, stream):
        self.waits.append((name, stream))


def _event_log(layers, inputs, make=two_batch):
    log = _EventLog()
    overlap.add_observer(log)
    try:
        run(make(layers, len(inputs)), layers, inputs)
    finally:
        overlap.remove_observer(log)
    return log


def test_events_are_reused_across_layers():
    inputs = _inputs(0)
    one = _event_log(_slow_layers(1, delay=0), inputs)
    four = _event_log(_slow_layers(4, delay=0), inputs)
    assert len(four.records) > len(one.records)
    assert {n for n, _ in four.records} == {n for n, _ in one.records}
    assert all(n.startswith(("mb0.", "mb1.")) for n, _ in four.records)


def _fake_torchair(monkeypatch, calls):
    """torchair's scope (ge) and npugraph_ex's scope and tagged events (aclgraph), recording the calls."""
    import contextlib

    scope = types.ModuleType("torchair.scope")
    scope.npu_stream_switch = lambda tag, priority=0: contextlib.nullcontext()

    def npu_wait_tensor(x, dep):
        calls.append(("wait_tensor", tuple(dep.shape)))
        return x + 0  # a new tensor, as the graph op returns
    scope.npu_wait_tensor = npu_wait_tensor
    pkg = types.ModuleType("torchair")
    pkg.scope = scope
    tagged = types.ModuleType("npugraph_ex.ops._tagged_event")
    tagged._npu_create_tagged_event = lambda tag: calls.append(("create", tag)) or object()
    ex_scope = types.ModuleType("npugraph_ex.scope")
    ex_scope.limit_core_num = lambda aic, aiv: contextlib.nullcontext()
    ex_ops = types.ModuleType("npugraph_ex.ops")
    ex_ops._tagged_event = tagged
    ex = types.ModuleType("npugraph_ex")
    ex.scope, ex.ops = ex_scope, ex_ops
    ops = types.SimpleNamespace(scope_enter=lambda keys, values: None, scope_exit=lambda: None,
                                tagged_event_record=lambda tag: calls.append(("record", tag)),
                                tagged_event_wait=lambda tag: calls.append(("wait", tag)),
                                record_tagged_stream_=lambda t, tag: calls.append(("record_stream", tag)))
    # the backend emits torch.ops.npugraph_ex.*(...) itself; stand in for those ops
    monkeypatch.setattr(overlap.backends.aclgraph, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(
        npugraph_ex=ops)))
    monkeypatch.setattr(STATE, "tagged_events", {})
    for name, mod in (("torchair", pkg), ("torchair.scope", scope), ("npugraph_ex", ex),
                      ("npugraph_ex.scope", ex_scope), ("npugraph_ex.ops", ex_ops),
                      ("npugraph_ex.ops._tagged_event", tagged)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(STATE, "events", {})


def _local_layers(n_layers):
    return [moe_layer(i, lambda x: x.flip(0) * 2) for i in range(n_layers)]


def test_aclgraph_creates_each_tagged_event_once(monkeypatch):
    inputs = _inputs(0)
    counts = []
    for n_layers in (1, 3):
        calls = []
        _fake_torchair(monkeypatch, calls)
        with overlap.use_path("aclgraph"):
            run(two_batch(_local_layers(n_layers), 2), _local_layers(n_layers), inputs)
        created = [c[1] for c in calls if c[0] == "create"]
        assert len(created) == len(set(created))
        assert sum(c[0] == "wait" for c in calls) >= len(created) - 1
        assert any(c[0] == "record_stream" for c in calls)
        counts.append(sorted(created))
    assert counts[0] == counts[1]


def test_ge_adds_no_events_and_orders_comm_with_wait_tensor(monkeypatch):
    calls = []
    _fake_torchair(monkeypatch, calls)
    layers, inputs = _local_layers(2), _inputs(0)
    ref = run(serial(layers, 2), layers, inputs)
    schedule = two_batch(layers, 2)
    log = _EventLog()
    overlap.add_observer(log)
    try:
        with overlap.use_path("ge"):
            lowering, _ = lower(schedule, layers, inputs)
            out = run(schedule, layers, inputs)
    finally:
        overlap.remove_observer(log)
    assert not log.records and not log.waits and not lowering.events()
    assert sum(c[0] == "wait_tensor" for c in calls) == len(schedule.orders) > 0
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


# ---- bad schedules fail before anything runs -----------------------------------------------------

def test_bad_schedule_fails_before_any_launch():
    launched = []
    layers = [[Operation("a", lambda h: launched.append("a") or h, ("hidden",), ("t",)),
               Operation("b", lambda t: launched.append("b") or t, ("t",), ("out",), overlap.EP_COMM)]]
    bad = Schedule("bad", (ScheduledOp(0, 0, "b", overlap.EP_COMM), ScheduledOp(0, 0, "a")))
    with pytest.raises(ScheduleError, match="reads mb0's 't' of layer 0 before it is written, which 'a' writes"):
        run(bad, layers, [{"hidden": torch.ones(2)}])
    assert launched == []


def test_event_tag_names_microbatch_op_and_stream():
    assert event_tag(ScheduledOp(1, 5, "combine", overlap.EP_COMM)) == "mb1.combine@ep_comm"


# ---- the reference model with the expert-parallel MoE -------------------------------------------

def _model_body(ctx, per_rank_lens):
    from collectives import wrap_expert_parallel
    from launch.models import PRESETS, build_model
    from microbatch.batch import Batch
    from microbatch.planning.split import decide_split
    from microbatch.split import merge_outputs, prefix_kv, split_batch
    from overlap.observability.sanitizer import Sanitizer

    cfg = PRESETS["tiny"]
    lens = per_rank_lens[ctx.rank]
    batch = Batch.random(lens, cfg.vocab, seed=10 + ctx.rank)
    model = build_model(cfg, seed=3)
    model.replace_moe(lambda layer: wrap_expert_parallel(layer.moe, ctx.group))
    split = decide_split(lens, ctx.group, min_tokens=4)
    assert not split.serial
    layers = [layer.operations() for layer in model.layers]
    assert any(op.stream == overlap.EP_COMM for ops in layers for op in ops), "no EP communication in the model"
    results = {}
    with torch.no_grad():
        ref = model.forward_microbatches(batch, split)
        b0, b1 = split_batch(batch, split)
        inputs = [{"hidden": model.embed_tokens(b0.tokens), "seq": b0.seq, "prefix_kv": None},
                  {"hidden": model.embed_tokens(b1.tokens), "seq": b1.seq,
                   "prefix_kv": FromMicroBatch(0, "k", "v", fn=lambda k, v: prefix_kv(split, k, v))}]
        for name, make in SCHEDULES.items():
            with Sanitizer(raise_on_race=False) as san:
                h0, h1 = run(make(layers, 2), layers, inputs)
                overlap.synchronize()
            results[name] = (merge_outputs(split, model.norm(h0), model.norm(h1)), [str(r) for r in san.races])
    return ref, results, split.cut is not None


def test_reference_model_two_batch_equals_serial():
    """Tiny model, EP MoE on 2 ranks (rank 1 cuts a request across micro-batches)."""
    per_rank = run_ranks(_model_body, 2, [[9, 4, 11], [30]], timeout=120)
    assert any(cut for _, _, cut in per_rank)
    for ref, results, _ in per_rank:
        for name, (out, races) in results.items():
            assert torch.equal(out, ref), f"{name} differs from forward_microbatches"
            assert not races, f"{name}: {races[:3]}"


def test_overlap_switched_off_runs_every_schedule_on_one_stream():
    layers, inputs = _slow_layers(2, delay=0.01), _inputs(0)
    ref = run(serial(layers, 2), layers, inputs)
    with overlap.enabled(False):
        out = run(two_batch(layers, 2), layers, inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


# ---- graph mode: the executor traced by torch.compile(fullgraph=True) against torchair's own code ----

def _graph_case(n_layers=2):
    layers = [weightless_layer() for _ in range(n_layers)]
    schedule = two_batch(layers, 2)

    def fn(h0, h1):
        return run(schedule, layers, [{"hidden": h0}, {"hidden": h1}])
    return layers, schedule, fn, tuple(x["hidden"] for x in _inputs(0))


def _serial_eager(layers, args):
    with overlap.use_path("cpu"):
        return run(serial(layers, 2), layers, [{"hidden": a} for a in args])


def test_ge_graph_has_wait_tensor_per_intent_and_no_events():
    tc = pytest.importorskip("tools.torchair_contract")
    tc.load_torchair()
    layers, schedule, fn, args = _graph_case()
    gm = tc.capture_graph(fn, *args, path="ge")
    assert not tc.nodes(gm, "tagged_event_record") and not tc.nodes(gm, "tagged_event_wait")
    waits = tc.nodes(gm, "wait_tensor")
    assert len(waits) == len(schedule.orders) > 0
    streams = tc.stream_of(gm)
    assert all(streams[w.name] == overlap.EP_COMM for w in waits)
    assert tc.discarded_waits(gm) == [], "a wait_tensor whose result is not used orders nothing on GE"
    assert tc.unordered_reads(gm, "ge") == []
    out = tc.strip_air(gm)(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, _serial_eager(layers, args)))


def test_aclgraph_graph_records_before_every_wait():
    tc = pytest.importorskip("tools.torchair_contract")
    tc.load_torchair()
    layers, schedule, fn, args = _graph_case()
    gm = tc.capture_graph(fn, *args, path="aclgraph")
    assert not tc.nodes(gm, "wait_tensor")
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    records = tc.nodes(gm, "tagged_event_record")
    streams = tc.stream_of(gm)
    for wait in tc.nodes(gm, "tagged_event_wait"):
        tag = wait.args[0]
        earlier = [r for r in records if r.args[0] == tag and at[r] < at[wait]]
        assert earlier, f"wait for {tag} before any record"
        assert streams[earlier[-1].name] == tag.split("@")[1] != streams[wait.name]
    lowering, _ = lower(schedule, layers, [{"hidden": a} for a in args], path="aclgraph")
    assert {r.args[0] for r in records} == set(lowering.events())
    assert tc.nodes(gm, "record_tagged_stream_")
    assert tc.unordered_reads(gm, "aclgraph") == [], "every cross-stream read waits for a record after its writer"
    out = tc.strip_air(gm)(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, _serial_eager(layers, args)))


# ---- lowered ahead of a trace --------------------------------------------------------------------

def test_a_schedule_lowered_ahead_runs_as_run_does_and_refuses_what_it_was_not_lowered_for():
    """`lower_ahead` + `Lowered.run` (what a compiled function calls) computes `run`'s result with each call's
    values; other input names, another path or another caller stream is a one-line ScheduleError before any
    launch."""
    launched = []
    layers = [moe_layer(i, lambda x: launched.append(1) or x.flip(0)) for i in range(2)]
    first, second = _inputs(0), _inputs(1)
    lowered = lower_ahead(two_batch, layers, first, "cpu")
    with overlap.use_path("cpu"):
        for inputs in (first, second):
            want = run(two_batch(layers, 2), layers, inputs)
            got = lowered.run(inputs)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        launched.clear()
        renamed = [{"hidden": i["hidden"], "extra": None} for i in first]
        with pytest.raises(ScheduleError, match=r"lowered for the inputs \[hidden\], \[hidden\] got "
                                                r"\[extra, hidden\], \[extra, hidden\]") as err:
            lowered.run(renamed)
        assert "\n" not in str(err.value)
        with overlap.stream(overlap.SHARED_EXPERT), pytest.raises(ScheduleError, match="on stream 'shared_expert'"):
            lowered.run(first)
    with overlap.use_path("ge"), pytest.raises(ScheduleError, match="lowered for path 'cpu' .* runs on path 'ge'"):
        lowered.run(first)
    assert launched == []


# ---- one interpreter -----------------------------------------------------------------------------

def test_every_run_of_a_schedule_is_interpreted_by_one_function(monkeypatch):
    """Kept or not, observed or not, switched off, lowered ahead, run once (`execute`) or on a graph path: the
    operations are called by `microbatch.program.interpret` and nothing else (a second interpreter would show
    here), and the graph paths keep no program."""
    from microbatch import execute, replay
    from microbatch.program import interpret
    from overlap import Timeline

    callers = []

    def layer(i):
        ops = moe_layer(i, lambda x: x.flip(0) * 2)
        return [Operation(o.name, _calling(o.fn, callers), o.reads, o.writes, o.stream) for o in ops]

    layers, inputs = [layer(i) for i in range(2)], _inputs(0)
    schedule = two_batch(layers, 2)
    ways = {
        "first": lambda: run(schedule, layers, inputs),
        "replayed": lambda: run(schedule, layers, inputs),
        "off": lambda: _off(lambda: run(schedule, layers, inputs)),
        "execute": lambda: execute(*lower(schedule, layers, inputs), inputs),
        "lowered ahead": lambda: lower_ahead(two_batch, layers, inputs, "cpu").run(inputs),
    }
    ref = run(serial(layers, 2), layers, inputs)
    seen = {}
    for name, way in ways.items():
        callers.clear()
        out = way()
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), name
        seen[name] = set(callers)
        if name == "replayed":
            callers.clear()
            with Timeline() as tl:
                way()
                overlap.synchronize()
            assert tl.spans
            seen["observed"] = set(callers)
    kept = replay.replay_stats()["kept"]
    for path in ("ge", "aclgraph"):
        _fake_torchair(monkeypatch, [])
        callers.clear()
        with overlap.use_path(path):
            run(schedule, layers, inputs)
        seen[path] = set(callers)
    assert replay.replay_stats()["kept"] == kept
    assert seen == {name: {interpret.__code__} for name in seen}, seen


def _calling(fn, callers):
    """``fn``, noting the code of the function that calls it."""
    def op(*args):
        callers.append(sys._getframe(1).f_code)
        return fn(*args)
    return op


def _off(fn):
    with overlap.enabled(False):
        return fn()


def test_an_operation_that_returns_the_wrong_number_of_values_says_so_on_every_run():
    """An operation writing two values must return a tuple of two: a TypeError naming it and its values, whether
    its program was just lowered, is replayed or runs once (`execute`)."""
    from microbatch import execute

    layers = [[Operation("split", lambda h: h, ("hidden",), ("a", "b")),
               Operation("out", lambda a, b: a + b, ("a", "b"), ("out",))]]
    inputs = [{"hidden": torch.ones(2)}]
    schedule = serial(layers, 1)
    message = r"operation 'split' must return 2 values for \('a', 'b'\)"
    for _ in range(2):  # lowered, then replayed
        with pytest.raises(TypeError, match=message):
            run(schedule, layers, inputs)
    with pytest.raises(TypeError, match=message):
        execute(*lower(schedule, layers, inputs), inputs)
