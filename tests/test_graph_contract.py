"""Graph-mode contract: what the ``ge`` and ``aclgraph`` lowerings put into a captured FX graph.

A small two-stream function written only with the toolkit's primitives is traced with
``torch.compile(fullgraph=True)`` against torchair's own ``scope`` / ``ops`` code from the torch_npu
wheel (see tests/torchair_contract.py). Skipped, with the reason, when the wheel cannot be fetched.
"""
import operator
import sys

import pytest
import torch

import overlap
import torchair_contract as tc

EVENT = "contract_comm_done"  # an event tag of its own: torchair's tagged events are process-wide
SIDE_AIC, SIDE_AIV = 8, 16


@pytest.fixture(scope="module", autouse=True)
def torchair():
    return tc.load_torchair()


def two_stream(x, w1, w2):
    """Main stream: two matmuls. Side stream (EP_COMM, core-limited): work on the first one's output."""
    done = overlap.event(EVENT)
    h = x @ w1
    with overlap.stream(overlap.EP_COMM):
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


def _check_side_scope(gm):
    """The side-stream multiply sits in an ``ep_comm`` scope with the core limit; the matmuls do not."""
    scopes = tc.scope_of(gm)
    enters = tc.nodes(gm, "scope_enter")
    assert len(enters) == len(tc.nodes(gm, "scope_exit")) == 2, tc.ops_in_order(gm, air_only=True)
    labels = [tc.scope_attrs(n) for n in enters]
    assert labels[0]["_user_stream_label"] == overlap.EP_COMM
    assert labels[0]["_user_stream_priority"] == "0"
    assert labels[1] == {"_op_aicore_num": str(SIDE_AIC), "_op_vectorcore_num": str(SIDE_AIV)}
    mul = _one(gm, operator.mul)
    assert scopes[mul.name]["_user_stream_label"] == overlap.EP_COMM
    assert (scopes[mul.name]["_op_aicore_num"], scopes[mul.name]["_op_vectorcore_num"]) == ("8", "16")
    for mm in tc.node_by_target(gm, operator.matmul) + [_one(gm, torch.relu), _one(gm, operator.add)]:
        assert "_user_stream_label" not in scopes[mm.name] and "_op_aicore_num" not in scopes[mm.name], mm.name
    return mul


def test_ge_stream_scope_core_limit_and_wait_tensor():
    gm = tc.capture_graph(two_stream, *_inputs(), path="ge")
    mul = _check_side_scope(gm)
    assert not tc.nodes(gm, "tagged_event_record") and not tc.nodes(gm, "tagged_event_wait")
    assert not tc.nodes(gm, "record_tagged_stream_"), "ge plans memory itself: no record_tagged_stream"
    (wait,) = tc.nodes(gm, "wait_tensor")
    relu, add = _one(gm, torch.relu), _one(gm, operator.add)
    assert wait.args == (relu, mul), "event wait on ge: wait_tensor(consumer, guarded)"
    assert add.args == (mul, wait), "the consumer must use the tensor wait_tensor returns"
    assert tc.stream_of(gm)[wait.name] == overlap.DEFAULT


def test_ge_explicit_wait_tensor_is_a_control_edge():
    gm = tc.capture_graph(explicit_edge, *_inputs()[:2], path="ge")
    (wait,) = tc.nodes(gm, "wait_tensor")
    mm, sin = _one(gm, operator.matmul), _one(gm, "sin")
    assert wait.args == (sin, mm)
    streams = tc.stream_of(gm)
    assert streams[mm.name] == overlap.SHARED_EXPERT and streams[sin.name] == overlap.DEFAULT
    assert _one(gm, operator.mul).args[0] is wait


def test_aclgraph_tagged_events_in_order():
    gm = tc.capture_graph(two_stream, *_inputs(), path="aclgraph")
    mul = _check_side_scope(gm)
    assert not tc.nodes(gm, "wait_tensor"), "npu_wait_tensor raises on aclgraph: events only"
    (rec,), (wait,) = tc.nodes(gm, "tagged_event_record"), tc.nodes(gm, "tagged_event_wait")
    (keep,) = tc.nodes(gm, "record_tagged_stream_")
    assert rec.args[0] == wait.args[0] == EVENT
    h = tc.node_by_target(gm, operator.matmul)[0]
    assert keep.args == (h, overlap.EP_COMM)
    streams, at = tc.stream_of(gm), _index(gm)
    assert streams[rec.name] == streams[keep.name] == overlap.EP_COMM, "record on the side stream"
    assert streams[wait.name] == overlap.DEFAULT, "wait on the consuming (main) stream"
    relu, add = _one(gm, torch.relu), _one(gm, operator.add)
    assert at[mul] < at[rec] < at[wait] < at[add], tc.ops_in_order(gm)
    assert at[relu] < at[wait], "main-stream work between record and wait is what overlaps"


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
    gm = tc.strip_air(tc.capture_graph(two_stream, *args, path=path))
    out = gm(*args)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, expected)


def test_core_oversubscription_is_refused_while_tracing():
    overlap.set_core_budget(overlap.CoreBudget(12, 24, "test"))

    def oversubscribed(x, w1, w2):
        with overlap.limit_cores(8, 16):  # main stream
            y = x @ w1
        return two_stream(y, w1, w2)  # side stream asks for 8|16 more: 16|32 > 12|24

    with pytest.raises(Exception, match=r"add up to 16\|32"):
        tc.capture_graph(oversubscribed, *_inputs(), path="ge")


def test_loader_leaves_the_process_clean():
    tc.capture_graph(two_stream, *_inputs(), path="aclgraph")
    assert "torchair" not in sys.modules and "torch_npu" not in sys.modules
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
