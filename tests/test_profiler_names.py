"""The executor's launches named in a profiler (``overlap:mb1.L3.dispatch@ep_comm``) while one records, and
nothing added while none does; ``overlap-report`` finding those operations in a torch.profiler trace."""
import collections
import json

import pytest
import torch
from click.testing import CliRunner
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

import overlap
from microbatch import lower_ahead, run, serial, two_batch
from overlap import Timeline, hooks
from overlap.observability.report import analyse, main
from overlap.observability._operations import operation_figures
from overlap.multirank import run_ranks
from support.layers import weightless_layer

N_LAYERS = 2


@pytest.fixture(autouse=True)
def _on_main_stream():
    with overlap.stream(overlap.DEFAULT):
        yield


def _inputs():
    return [{"hidden": torch.randn(4, 8, generator=torch.Generator().manual_seed(mb))} for mb in range(2)]


def _expected(schedule, layers):
    """Each launch's name: its operation, micro-batch, layer and stream; the host issuing an EP_COMM operation."""
    stream_of = {(li, op.name): op.stream for li, ops in enumerate(layers) for op in ops}
    return collections.Counter(
        hooks.launch_name(l.op, l.mb, l.layer, l.stream,
                          "issue" if stream_of[l.layer, l.op] == overlap.EP_COMM else "compute")
        for l in schedule.launches)


def _profiled(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof, collections.Counter(e.name for e in prof.events() if e.name.startswith(hooks.PROFILER_PREFIX))


def test_launch_names_read_back():
    assert hooks.launch_name("experts", 1, 3, "default") == "overlap:mb1.L3.experts@default"
    assert hooks.launch_name("dispatch", 0, 12, "ep_comm", "issue") == "overlap:mb0.L12.dispatch@ep_comm (issue)"
    for args in (("experts", 1, 3, "default", "compute"), ("dispatch.counts", 0, 12, "ep_comm", "issue"),
                 ("shared_gate_up", 2, 0, "shared_expert", "compute")):
        assert tuple(hooks.parse_launch_name(hooks.launch_name(*args))) == (args[1], args[2], args[0], *args[3:])
    for other in ("aten::mm", "gloo:all_to_all", "overlap:mb1.experts@default", "overlap:mbx.L3.a@b",
                  "overlap:mb1.L3.experts@default trailing"):
        assert hooks.parse_launch_name(other) is None, other


@pytest.mark.parametrize("make", [two_batch, serial], ids=["two-batch", "serial"])
def test_a_profiled_run_names_every_launch(make):
    layers = [weightless_layer() for _ in range(N_LAYERS)]
    schedule = make(layers, 2)
    for _ in range(2):  # the first run lowers and keeps its program; the second replays it
        _, names = _profiled(lambda: run(schedule, layers, _inputs()))
        assert names == _expected(schedule, layers)
    assert "overlap:mb1.L1.dispatch@" + ("ep_comm" if make is two_batch else "default") + " (issue)" in names


def test_nothing_named_while_no_profiler_records(monkeypatch):
    """The lean path calls no record_function (it costs microseconds even when nothing records): patched to fail,
    a run with nobody watching and one under a Timeline pass; a profiled run reaches it."""
    layers = [weightless_layer() for _ in range(N_LAYERS)]
    schedule = two_batch(layers, 2)
    want = run(schedule, layers, _inputs())

    def refused(name):
        raise AssertionError(f"record_function({name!r}) called")
    monkeypatch.setattr(torch.autograd.profiler, "record_function", refused)
    assert not hooks.profiling()
    for a, b in zip(run(schedule, layers, _inputs()), want):
        assert torch.equal(a, b)
    with Timeline() as tl:
        run(schedule, layers, _inputs())
    assert len(tl.find(name="dispatch", kind="issue")) == 2 * N_LAYERS  # observed: spans, and no range
    with pytest.raises(AssertionError, match=r"record_function\('overlap:mb0\.L0\.attn@default'\) called"):
        _profiled(lambda: run(schedule, layers, _inputs()))


def test_a_compiled_run_traces_whole_while_profiled():
    """Dynamo drops record_function ranges, and reading the profiler's flag would break the graph: while it traces,
    the executor names nothing (fullgraph=True compiles under a profiler)."""
    layers = [weightless_layer() for _ in range(N_LAYERS)]
    inputs = _inputs()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    try:
        with overlap.enabled(False):
            lowered = lower_ahead(two_batch, layers, inputs, "cpu")
            compiled = torch.compile(lambda h0, h1: lowered.run([{"hidden": h0}, {"hidden": h1}]), backend=keep,
                                     fullgraph=True)
            _, names = _profiled(lambda: compiled(inputs[0]["hidden"], inputs[1]["hidden"]))
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1 and not names


def test_the_report_finds_the_operations_of_a_profiled_run(tmp_path):
    layers = [weightless_layer() for _ in range(N_LAYERS)]
    schedule = two_batch(layers, 2)
    prof, _ = _profiled(lambda: run(schedule, layers, _inputs()))
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    trace, m = analyse(path)
    (process, ops), = operation_figures(trace.items, trace.launches).items()
    found = {(op.label, op.kind): op.launches for op in ops.operations}
    expected = collections.Counter()
    for name, n in _expected(schedule, layers).items():
        launch = hooks.parse_launch_name(name)
        expected[f"{launch.op}@{launch.stream}", launch.kind] += n
    assert found == dict(expected)
    for op in ops.operations:
        assert op.span > 0
        if op.kind == "issue":  # the host issuing an exchange: none of it is busy time
            assert sum(op.busy.values()) == 0, op
        else:
            assert sum(op.busy.values()) == pytest.approx(op.span, rel=1e-6), op
    text = CliRunner().invoke(main, [path], catch_exceptions=False).output
    assert "op    experts@default" in text and "issue: the host's time" in text, text


def _host_trace(gloo_from_us, gloo_to_us):
    """Rank 0 on CPU: the host issues mb0's dispatch (100..200 us, an aten op inside), then computes mb1's attn
    (200..500 us, an aten op inside); gloo's thread runs the exchange from ``gloo_from_us`` to ``gloo_to_us``."""
    x = lambda cat, name, tid, ts, dur: {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid,  # noqa: E731
                                        "ts": 1e9 + ts, "dur": dur, "args": {}}
    return {"distributedInfo": {"rank": 0}, "traceEvents": [
        x("user_annotation", "overlap:mb0.L0.dispatch@ep_comm (issue)", 7, 100, 100),
        x("cpu_op", "aten::argsort", 7, 110, 80),
        x("user_annotation", "overlap:mb1.L0.attn@default", 7, 200, 300),
        x("cpu_op", "aten::mm", 7, 210, 280),
        x("user_annotation", "gloo:all_to_all", 8, gloo_from_us, gloo_to_us - gloo_from_us)]}


def test_a_launch_on_the_host_is_what_its_name_says(tmp_path):
    """The host's ops inside a dispatch are its issuing, not compute (nor communication, as the name 'dispatch'
    alone would say): the exchange under them is not hidden; under the attn it is."""
    path = tmp_path / "host.json"
    path.write_text(json.dumps(_host_trace(100, 300)))
    trace, m = analyse(str(path))
    rm = m.per_rank["rank 0 process 7"]
    assert rm.busy == pytest.approx({"thread 7": 300e-6, "thread 8": 200e-6})  # the attn; the exchange
    assert rm.hidden_share == pytest.approx(0.5)  # 200..300 of 100..300
    ops = {op.label: op for op in operation_figures(trace.items, trace.launches)["rank 0 process 7"].operations}
    assert ops["dispatch@ep_comm"].kind == "issue" and ops["dispatch@ep_comm"].busy == {"thread 7": 0.0}
    assert ops["attn@default"].busy == pytest.approx({"thread 7": 300e-6})
    assert ops["attn@default"].hidden_comm == pytest.approx(100e-6)


def test_a_host_op_named_like_communication_is_compute(tmp_path):
    """On a host thread only a process group's own work is communication: aten::broadcast_tensors and the
    sanitizer's PythonDispatchMode (named like 'broadcast' and 'dispatch') computed under the exchange."""
    trace = _host_trace(0, 200)
    x = lambda name, ts: {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": 7, "ts": 1e9 + ts,  # noqa: E731
                          "dur": 100, "args": {}}
    trace["traceEvents"] = [x("aten::broadcast_tensors", 0), x("PythonDispatchMode", 100), trace["traceEvents"][-1]]
    (tmp_path / "host.json").write_text(json.dumps(trace))
    rm = analyse(str(tmp_path / "host.json"))[1].per_rank["rank 0 process 7"]
    assert rm.comm_time == pytest.approx(200e-6) and rm.hidden_share == pytest.approx(1.0)


def _device_trace():
    """One GPU: stream 7 computes mb0's experts (kernel 0..100 us) and mb1's attn (120..200 us) and a kernel
    outside any launch (300..320 us); stream 13 runs mb1's dispatch, its NCCL kernel 50..150 us; kineto's
    gpu_user_annotation ranges place each launch on its stream, the host's user_annotation ranges are ignored."""
    def x(cat, name, tid, ts, dur, pid=0):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": 1e9 + ts, "dur": dur,
                "args": {"stream": tid} if pid == 0 else {}}
    return {"distributedInfo": {"rank": 1}, "traceEvents": [
        x("user_annotation", "overlap:mb0.L0.experts@default", 99, -20, 5, pid=99),
        x("gpu_user_annotation", "overlap:mb0.L0.experts@default", 7, 0, 100),
        x("kernel", "sm90_gemm", 7, 0, 100),
        x("gpu_user_annotation", "overlap:mb1.L0.attn@default", 7, 110, 90),
        x("kernel", "vectorized_elementwise_kernel", 7, 120, 80),
        x("kernel", "reduce_kernel", 7, 300, 20),
        x("gpu_user_annotation", "overlap:mb1.L0.dispatch@ep_comm (issue)", 13, 40, 120),
        x("kernel", "ncclDevKernel_SendRecv", 13, 50, 100)]}


def test_device_kernels_are_named_by_their_launch(tmp_path):
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(_device_trace()))
    trace, m = analyse(str(path))
    rm = m.per_rank["rank 1 device 0"]
    assert rm.hidden_share == pytest.approx(0.8)  # 50..100 and 120..150 of 50..150
    ro = operation_figures(trace.items, trace.launches)["rank 1 device 0"]
    ops = {op.label: op for op in ro.operations}
    assert ops["experts@default"].busy == pytest.approx({"stream 7": 100e-6})
    assert ro.hidden_share(ops["experts@default"]) == pytest.approx(0.5)
    assert ops["attn@default"].busy == pytest.approx({"stream 7": 80e-6}) and ops["attn@default"].span == pytest.approx(90e-6)
    assert ro.hidden_share(ops["attn@default"]) == pytest.approx(0.3)
    assert ops["dispatch@ep_comm"].busy == pytest.approx({"stream 13": 100e-6})
    assert ro.outside == pytest.approx({"stream 7": 20e-6, "stream 13": 0.0})
    data = json.loads(CliRunner().invoke(main, [str(path), "--json"], catch_exceptions=False).output)
    named = {o["operation"]: o for o in data["ranks"]["rank 1 device 0"]["operations"]}
    assert named["experts"]["hidden_share"] == pytest.approx(0.5) and named["dispatch"]["kind"] == "issue"


def _profiled_prefill(ctx, folder):
    from launch.engine import make_expert_parallel, prefill, split_for
    from launch.models import build_model, preset
    from microbatch import Batch

    model = make_expert_parallel(build_model(preset("tiny"), seed=0), ctx.group)
    batch = Batch.random([24, 16], model.cfg.vocab, seed=1 + ctx.rank)
    split = split_for("two-batch", batch, ctx.group, model=model)
    prefill(model, batch, "two-batch", split)
    with profile(activities=[ProfilerActivity.CPU],
                 on_trace_ready=tensorboard_trace_handler(folder, worker_name=f"rank{ctx.rank}")), Timeline() as tl:
        prefill(model, batch, "two-batch", split)
    return collections.Counter(s.name for s in tl.spans if s.kind in ("compute", "issue") and "mb" in s.meta)


@pytest.mark.spawns_ranks
def test_a_profiled_two_rank_prefill_names_its_operations(tmp_path):
    """Two CPU ranks profile a two-batch prefill of the tiny model (under a Timeline as well); the folder of
    their traces names every operation the timeline saw, on each rank."""
    spans = run_ranks(_profiled_prefill, 2, str(tmp_path), timeout=240)
    trace, m = analyse(str(tmp_path))
    assert len(trace.files) == 2 and len(m.per_rank) == 2
    figures = operation_figures(trace.items, trace.launches)
    assert len(figures) == 2, sorted(figures)  # each rank's trace names the toolkit's launches
    for process, ro in figures.items():
        rank = int(process.split()[1])
        assert {op.op: op.launches for op in ro.operations} == dict(spans[rank]), process
        kinds = {op.op: op.kind for op in ro.operations}
        assert kinds["dispatch"] == kinds["combine"] == "issue" and kinds["experts"] == "compute"
        assert ro.comm_time > 0
