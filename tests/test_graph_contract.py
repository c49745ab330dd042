"""Graph-mode contract: what the ``ge`` and ``aclgraph`` lowerings put into a captured FX graph.

A small two-stream function written only with the toolkit's primitives, and the executor's
two-batch schedule, are traced with ``torch.compile(fullgraph=True)`` against torchair's and
npugraph_ex's own ``scope`` / ``ops`` code from the torch_npu wheel (see tests/tools/torchair_contract.py):
the scopes, events and edges in the graph, and that every cross-stream read is ordered. Skipped, with
the reason, when the wheel cannot be fetched.
"""
import operator
import sys

import pytest
import torch

import overlap
from support.layers import weightless_layer
from tools import torchair_contract as tc

EVENT = "contract_comm_done"  # event tags of their own: tagged events are process-wide
READY = "contract_h_ready"
MAIN_AIC, MAIN_AIV = 16, 32
SIDE_AIC, SIDE_AIV = 8, 16


@pytest.fixture(scope="module", autouse=True)
def torchair():
    return tc.load_torchair()


def two_stream(x, w1, w2):
    """Main stream: two matmuls, the first core-limited. Side stream (EP_COMM, core-limited): work on its output."""
    ready, done = overlap.event(READY), overlap.event(EVENT)
    with overlap.limit_cores(MAIN_AIC, MAIN_AIV):  # the main stream's share first, then the side stream's
        h = x @ w1
    ready.record(h)
    with overlap.stream(overlap.EP_COMM):
        ready.wait()  # h is read on the side stream (ge: the data edge orders it, nothing added)
        with overlap.limit_cores(SIDE_AIC, SIDE_AIV):
            comm = h * 2  # stands for the dispatch issued on the side stream
        overlap.record_stream(h, overlap.EP_COMM)  # h is read on the side stream
        done.record(comm)
    local = torch.relu(x @ w2)  # overlaps with the side stream
    local = done.wait(local)  # ordering edge: the sum below must see comm finished
    return comm + local


def explicit_edge(x, w):
    """An ordering edge without data: ``y`` is consumed only after the shared-expert stream's ``s``."""
    with overlap.stream(overlap.SHARED_EXPERT):
        s = x @ w
    y = overlap.wait_tensor(x.sin(), s)
    return y * 3


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 4, generator=g) for _ in range(3))


def _one(gm, target):
    found = tc.node_by_target(gm, target)
    assert len(found) == 1, (target, tc.ops_in_order(gm))
    return found[0]


def _index(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _check_scopes(gm):
    """The first matmul under the main stream's limit; the side multiply in an ``ep_comm`` scope with its own."""
    scopes = tc.scope_of(gm)
    enters = tc.nodes(gm, "scope_enter")
    assert len(enters) == len(tc.nodes(gm, "scope_exit")) == 3, tc.ops_in_order(gm, air_only=True)
    labels = [tc.scope_attrs(n) for n in enters]
    assert labels[0] == {"_op_aicore_num": str(MAIN_AIC), "_op_vectorcore_num": str(MAIN_AIV)}
    assert labels[1]["_user_stream_label"] == overlap.EP_COMM
    assert labels[1]["_user_stream_priority"] == "0"
    assert labels[2] == {"_op_aicore_num": str(SIDE_AIC), "_op_vectorcore_num": str(SIDE_AIV)}
    mul = _one(gm, operator.mul)
    assert scopes[mul.name]["_user_stream_label"] == overlap.EP_COMM
    assert (scopes[mul.name]["_op_aicore_num"], scopes[mul.name]["_op_vectorcore_num"]) == ("8", "16")
    h, local = tc.node_by_target(gm, operator.matmul)
    assert scopes[h.name] == {"_op_aicore_num": "16", "_op_vectorcore_num": "32"}
    for n in (local, _one(gm, torch.relu), _one(gm, operator.add)):
        assert "_user_stream_label" not in scopes[n.name] and "_op_aicore_num" not in scopes[n.name], n.name
    return mul


def test_ge_stream_scope_core_limit_and_wait_tensor():
    gm = tc.capture_graph(two_stream, *_inputs(), path="ge")
    mul = _check_scopes(gm)
    assert {tc.op_namespace(n) for n in gm.graph.nodes} - {None} == {"air"}, "ge is torchair's GE graph: air ops"
    assert not tc.nodes(gm, "tagged_event_record") and not tc.nodes(gm, "tagged_event_wait")
    assert not tc.nodes(gm, "record_tagged_stream_"), "ge plans memory itself: no record_tagged_stream"
    (wait,) = tc.nodes(gm, "wait_tensor")
    relu, add = _one(gm, torch.relu), _one(gm, operator.add)
    assert wait.args == (relu, mul), "event wait on ge: wait_tensor(consumer, guarded)"
    assert add.args == (mul, wait), "the consumer must use the tensor wait_tensor returns"
    assert tc.stream_of(gm)[wait.name] == overlap.DEFAULT
    assert tc.unordered_reads(gm, "ge") == [] and tc.discarded_waits(gm) == []


def test_ge_explicit_wait_tensor_is_a_control_edge():
    gm = tc.capture_graph(explicit_edge, *_inputs()[:2], path="ge")
    (wait,) = tc.nodes(gm, "wait_tensor")
    mm, sin, mul = _one(gm, operator.matmul), _one(gm, "sin"), _one(gm, operator.mul)
    assert wait.args == (sin, mm)
    streams = tc.stream_of(gm)
    assert streams[mm.name] == overlap.SHARED_EXPERT and streams[sin.name] == overlap.DEFAULT
    assert mul.args[0] is wait
    assert tc.Order(gm, "ge").before(mm, mul) and tc.discarded_waits(gm) == []


def test_aclgraph_lowers_to_npugraph_ex_tagged_events_in_order():
    gm = tc.capture_graph(two_stream, *_inputs(), path="aclgraph")
    mul = _check_scopes(gm)
    namespaces = {tc.op_namespace(n) for n in gm.graph.nodes} - {None}
    assert namespaces == {"npugraph_ex"}, "the npugraph_ex backend reads npugraph_ex ops, not air ones"
    assert not tc.nodes(gm, "wait_tensor"), "npu_wait_tensor raises on aclgraph: events only"
    (ready_rec, rec), (ready_wait, wait) = tc.nodes(gm, "tagged_event_record"), tc.nodes(gm, "tagged_event_wait")
    (keep,) = tc.nodes(gm, "record_tagged_stream_")
    assert ready_rec.args[0] == ready_wait.args[0] == READY and rec.args[0] == wait.args[0] == EVENT
    h = tc.node_by_target(gm, operator.matmul)[0]
    assert keep.args == (h, overlap.EP_COMM)
    streams, at = tc.stream_of(gm), _index(gm)
    assert streams[ready_rec.name] == streams[wait.name] == overlap.DEFAULT, "main records h, waits for comm"
    assert streams[ready_wait.name] == streams[rec.name] == streams[keep.name] == overlap.EP_COMM
    relu, add = _one(gm, torch.relu), _one(gm, operator.add)
    assert at[h] < at[ready_rec] < at[ready_wait] < at[mul] < at[rec] < at[wait] < at[add], tc.ops_in_order(gm)
    assert at[relu] < at[wait], "main-stream work between record and wait is what overlaps"
    assert tc.unordered_reads(gm, "aclgraph") == []


def test_aclgraph_compiles_with_the_npugraph_ex_backend():
    """The backend name and torchair's mode name are the ones the torch_npu wheel registers."""
    import zipfile

    backend = overlap.backends.get("aclgraph")
    assert backend.compile_backend() == "npugraph_ex" == backend.torchair_mode
    with zipfile.ZipFile(tc.find_wheel()) as whl:
        entry_points = next(whl.read(n).decode() for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt"))
        config = whl.read("torch_npu/dynamo/torchair/configs/compiler_config.py").decode()
    section = entry_points.split("[torch_dynamo_backends]")[1].split("[")[0]
    assert "npugraph_ex = " in section, entry_points
    assert '"npugraph_ex"' in config.split("self.mode = OptionValue(")[1].split(")")[0]


def test_aclgraph_refuses_wait_tensor_under_compile():
    with pytest.raises(Exception, match="wait_tensor has no aclgraph lowering"):
        tc.capture_graph(explicit_edge, *_inputs()[:2], path="aclgraph")


@pytest.mark.parametrize("path", ["ge", "aclgraph"])
def test_disabled_is_single_stream(path):
    with overlap.enabled(False):
        gm = tc.capture_graph(two_stream, *_inputs(), path=path)
        plain = tc.capture_graph(explicit_edge, *_inputs()[:2], path=path)
    assert tc.ops_in_order(gm, air_only=True) == [] and tc.ops_in_order(plain, air_only=True) == []


@pytest.mark.parametrize("path", ["ge", "aclgraph"])
def test_lowering_keeps_the_computation(path):
    """With the air ops removed the captured graph computes what the CPU path computes eagerly."""
    args = _inputs(1)
    with overlap.use_path("cpu"):
        expected = two_stream(*args)
    overlap.reset_core_limits()
    gm = tc.strip_air(tc.capture_graph(two_stream, *args, path=path))
    out = gm(*args)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, expected)


def test_core_oversubscription_is_refused_while_tracing():
    overlap.set_core_budget(overlap.CoreBudget(20, 40, "test"))
    with pytest.raises(Exception, match=r"add up to 24\|48 .*\(default: 16\|32; ep_comm: 8\|16\)"):
        tc.capture_graph(two_stream, *_inputs(), path="ge")  # 16|32 on main and 8|16 beside it: 24|48 > 20|40


def test_side_limit_beside_an_unlimited_main_stream_is_refused_while_tracing():
    def side_only(x, w1, w2):
        with overlap.stream(overlap.EP_COMM), overlap.limit_cores(SIDE_AIC, SIDE_AIV):
            return x @ w1

    with pytest.raises(Exception, match="ep_comm limited while the main stream 'default' is not"):
        tc.capture_graph(side_only, *_inputs(), path="aclgraph")


# ---- every cross-stream read ordered: the executor's graphs, and the check's own negative controls ----

def _executor_graph(path, n_layers=2):
    from microbatch import run, two_batch

    layers = [weightless_layer() for _ in range(n_layers)]
    schedule = two_batch(layers, 2)

    def fn(h0, h1):
        return run(schedule, layers, [{"hidden": h0}, {"hidden": h1}])
    return tc.capture_graph(fn, *_inputs()[:2], path=path), schedule


def _fifo_unordered(gm, path, label=overlap.EP_COMM):
    """Pairs of consecutive blocks on ``label`` whose nodes are not all ordered (the schedule keeps them FIFO)."""
    order, regions = tc.Order(gm, path), tc.stream_regions(gm, label)
    return [(a.name, b.name) for prev, nxt in zip(regions, regions[1:]) for a in prev for b in nxt
            if not order.before(a, b)]


@pytest.mark.parametrize("path", ["ge", "aclgraph"])
def test_every_cross_stream_read_of_the_executor_is_ordered(path):
    """For every value read on another stream than its writer's, an ordering edge reaches the reader."""
    gm, schedule = _executor_graph(path)
    reads = tc.cross_stream_reads(gm)
    streams = tc.stream_of(gm)
    assert {(streams[w.name], streams[r.name]) for w, r in reads} == {
        (overlap.DEFAULT, overlap.EP_COMM), (overlap.EP_COMM, overlap.DEFAULT)}
    assert tc.unordered_reads(gm, path) == []
    # the ordering intents without data (communication kept in schedule order on its stream)
    assert len(tc.stream_regions(gm, overlap.EP_COMM)) == 8 and len(schedule.orders) == 7
    assert _fifo_unordered(gm, path) == []
    assert tc.discarded_waits(gm) == []
    if path == "ge":
        assert len(tc.nodes(gm, "wait_tensor")) == len(schedule.orders)


def _aclgraph_edge(x, w, how):
    """Main writes ``h``, the side stream reads it; ``how`` says where the side stream's wait goes."""
    start, other = overlap.event("contract_h_done"), overlap.event("contract_other")
    other.record()  # an event recorded before the writer
    h = x @ w
    start.record(h)
    with overlap.stream(overlap.SHARED_EXPERT):
        if how == "before":
            start.wait()
        elif how == "other event":
            other.wait()
        s = h.sin()
        if how == "after":
            start.wait()
    return s


@pytest.mark.parametrize("how", ["none", "after", "other event"])
def test_the_order_check_catches_a_missing_late_or_wrong_wait_on_aclgraph(how):
    good = tc.capture_graph(_aclgraph_edge, *_inputs()[:2], "before", path="aclgraph")
    assert tc.unordered_reads(good, "aclgraph") == []
    bad = tc.capture_graph(_aclgraph_edge, *_inputs()[:2], how, path="aclgraph")
    (mm,), (sin,) = tc.node_by_target(bad, operator.matmul), tc.node_by_target(bad, "sin")
    assert tc.unordered_reads(bad, "aclgraph") == [f"{mm.name} (default) -> {sin.name} (shared_expert)"]


def test_the_order_check_takes_the_graphs_own_path_and_refuses_another():
    """A ge graph has no events: checked as an aclgraph one it would show every cross-stream read as a race."""
    ge = tc.capture_graph(two_stream, *_inputs(), path="ge")
    acl = tc.capture_graph(two_stream, *_inputs(), path="aclgraph")
    with overlap.enabled(False):
        plain = tc.capture_graph(two_stream, *_inputs(), path="ge")
    assert (tc.path_of(ge), tc.path_of(acl), tc.path_of(plain)) == ("ge", "aclgraph", None)
    assert tc.unordered_reads(ge) == tc.unordered_reads(acl) == tc.unordered_reads(plain) == []
    assert tc.Order(ge).path == "ge" and tc.Order(acl).path == "aclgraph"
    assert tc.unordered_reads(plain, "aclgraph") == []  # one stream: either model
    for gm, held, other in ((ge, "ge", "aclgraph"), (acl, "aclgraph", "ge")):
        with pytest.raises(ValueError, match=f"captured on the {held} path .*not on {other}: pass path='{held}'"):
            tc.unordered_reads(gm, other)
        with pytest.raises(ValueError, match=f"captured on the {held} path"):
            tc.Order(gm, other)
    with pytest.raises(ValueError, match="no ordering model for path 'npu'"):
        tc.unordered_reads(ge, "npu")


def _ge_intent(x, w, keep):
    """A side-stream block ordered after another one by ``wait_tensor``; ``keep``: use the result."""
    with overlap.stream(overlap.EP_COMM):
        first = x @ w
    y = x.cos()
    with overlap.stream(overlap.EP_COMM):
        waited = overlap.wait_tensor(y, first)
        second = (waited if keep else y) * 2
    return first, second


def test_the_order_check_catches_a_discarded_wait_tensor_on_ge():
    good = tc.capture_graph(_ge_intent, *_inputs()[:2], True, path="ge")
    assert tc.discarded_waits(good) == [] and _fifo_unordered(good, "ge") == []
    bad = tc.capture_graph(_ge_intent, *_inputs()[:2], False, path="ge")
    (mm,), (cos,), (mul,) = (tc.node_by_target(bad, t) for t in (operator.matmul, "cos", operator.mul))
    assert tc.discarded_waits(bad) == [f"wait_tensor({cos.name},{mm.name})"]
    assert _fifo_unordered(bad, "ge") == [(mm.name, mul.name)]


def test_loader_leaves_the_process_clean():
    tc.capture_graph(two_stream, *_inputs(), path="aclgraph")
    assert "torchair" not in sys.modules and "npugraph_ex" not in sys.modules and "torch_npu" not in sys.modules
    assert not hasattr(torch, "npu")
    assert overlap.current_path() in ("cpu", "cuda")
    with tc.installed() as mod:
        import torchair

        assert torchair is mod and hasattr(torchair.scope, "npu_stream_switch")


def test_unreachable_registry_gives_a_clear_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.ENV_CACHE, str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(RuntimeError, match="cannot download torch_npu"):
        tc.find_wheel()


def test_release_without_a_wheel_falls_back_to_its_minor_line(tmp_path, monkeypatch):
    wheel = tc.find_wheel()
    (tmp_path / wheel.rsplit("/", 1)[1]).symlink_to(wheel)
    major, minor = tc._torch_release().split(".")[:2]
    monkeypatch.setattr(tc, "_torch_release", lambda: f"{major}.{minor}.999")
    monkeypatch.setenv(tc.ENV_CACHE, str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    assert tc.find_wheel() == str(tmp_path / wheel.rsplit("/", 1)[1])
