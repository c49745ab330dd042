"""The timeline: spans for every launch, real completion times on CPU, Chrome trace, PNG and metrics."""
import json

import pytest
import torch

import overlap
from overlap import EP_COMM, KV_OFFLOAD, DEFAULT, Span, Timeline, hooks
from overlap.multirank import run_ranks
from overlap.backends.cpu import cpu_stream
from overlap.observability.timeline import chrome_trace, find, intersects, metrics, save_png

pytestmark = pytest.mark.cpu_only


@pytest.fixture(autouse=True)
def _cpu():
    overlap.set_path("cpu")
    yield
    overlap.synchronize()


def test_off_by_default():
    assert not hooks.active()
    assert hooks.start_span("x", DEFAULT, "compute") is None
    with Timeline() as tl:
        assert hooks.active()
    assert not hooks.active() and not tl.active


def test_records_launches_with_meta_and_async_completion():
    src = torch.randn(256, 256)
    dst = torch.empty_like(src)
    ev = overlap.event("test_tl_copy")
    with Timeline() as tl:
        with overlap.span("layer", mb=1, layer=2):
            with overlap.stream(KV_OFFLOAD):
                overlap.copy_(dst, src, name="offload")
                ev.record()
            with overlap.span("attn"):
                y = src @ src
            ev.wait()
    torch.testing.assert_close(dst, src)
    copy, = tl.find(name="offload")
    attn, = tl.find("attn", stream=DEFAULT, kind="compute")
    assert (copy.stream, copy.kind, copy.asynchronous, copy.rank) == (KV_OFFLOAD, "copy", True, 0)
    assert copy.meta == {"mb": 1, "layer": 2} and attn.meta == {"mb": 1, "layer": 2}
    assert copy.reads == () and copy.writes == ()  # the timeline keeps no tensors alive
    assert tl.find(layer=2, mb=1) == tl.spans and tl.find(layer=3) == []
    assert all(s.end >= s.start for s in tl.spans)
    layer, = tl.find("layer")
    assert layer.start <= copy.start and copy.end <= layer.end
    assert y.shape == (256, 256)


def test_launch_in_flight_at_stop_is_still_recorded():
    src = torch.randn(512, 512)
    dst = torch.empty_like(src)
    with Timeline() as tl:
        with overlap.stream(KV_OFFLOAD):
            overlap.copy_(dst, src, name="late")
    with overlap.span("after"):  # not recorded: the timeline has stopped
        pass
    overlap.synchronize()
    assert [s.name for s in tl.spans] == ["late"]
    assert not hooks.active()
    torch.testing.assert_close(dst, src)


def _span(name, stream, kind, start, end, rank=0):
    return Span(name=name, stream=stream, kind=kind, rank=rank, start=start, end=end)


def test_metrics_by_hand():
    spans = [_span("a0", DEFAULT, "compute", 0.0, 2.0), _span("a1", DEFAULT, "compute", 1.0, 3.0),  # union 0..3
             _span("d", EP_COMM, "comm", 2.0, 5.0),  # 1 s of 3 under compute
             _span("c", KV_OFFLOAD, "copy", 10.0, 11.0),
             _span("x", DEFAULT, "compute", 0.0, 1.0, rank=1), _span("y", EP_COMM, "comm", 1.0, 2.0, rank=1)]
    m = metrics(spans)
    r0 = m.per_rank[0]
    assert r0.busy == {DEFAULT: 3.0, EP_COMM: 3.0, KV_OFFLOAD: 1.0}
    assert m.overlap(DEFAULT, EP_COMM, rank=0) == 1.0 and m.overlap(EP_COMM, DEFAULT, rank=0) == 1.0
    assert m.ratio(DEFAULT, EP_COMM, rank=0) == pytest.approx(1 / 3)
    assert m.ratio(DEFAULT, KV_OFFLOAD, rank=0) == 0.0
    assert r0.hidden_share == pytest.approx(1 / 3)
    assert m.per_rank[1].hidden_share == 0.0
    assert m.hidden_share == pytest.approx(1 / 4)
    assert r0.busiest_pair() == tuple(sorted((DEFAULT, EP_COMM)))
    assert intersects(spans[0], spans[1]) and not intersects(spans[0], spans[2])  # touching is not overlap
    assert find(spans, stream=EP_COMM, rank=1) == [spans[5]]
    with pytest.raises(ValueError, match="pass rank="):
        m.ratio(DEFAULT, EP_COMM)


def _exchange_under_compute(ctx, x, a):
    """One all_to_all on the comm stream and a matmul loop on main; whether it was in flight under it."""
    out = torch.empty_like(x)
    sent = overlap.event("test_tl_sent")
    with Timeline() as tl:
        with overlap.stream(EP_COMM):
            overlap.all_to_all_single(out, x, group=ctx.group, name="dispatch", mb=0, layer=0)
            sent.record()
        with overlap.span("experts", mb=1, layer=0):
            in_flight = bool(cpu_stream(EP_COMM).snapshot())
            for i in range(2000):  # until the exchange has completed (bounded)
                a = torch.tanh(a @ a)
                if i >= 3 and not cpu_stream(EP_COMM).snapshot():
                    break
        out = sent.wait(out)
    return tl, out, in_flight


def _overlapped_rank(ctx):
    """all_to_all on the comm stream while a matmul loop runs on the main stream; returns gathered spans."""
    overlap.set_path("cpu")
    torch.manual_seed(ctx.rank)
    x = torch.randn(ctx.world_size * 512, 256) + ctx.rank
    a = torch.randn(96, 96)
    for _ in range(5):
        # On a loaded machine the host may reach the loop only after the exchange is over; then the
        # ranks agree to try again, so the check below is about overlap, not about scheduling luck.
        tl, out, in_flight = _exchange_under_compute(ctx, x, a)
        flag = torch.tensor([int(in_flight)])
        torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MIN, group=ctx.group)
        if flag.item():
            break
    expected = [torch.empty_like(x) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(expected, x, group=ctx.group)
    rows = x.shape[0] // ctx.world_size
    want = torch.cat([e[ctx.rank * rows:(ctx.rank + 1) * rows] for e in expected])
    torch.testing.assert_close(out, want)
    return tl.gather(ctx.group)


def test_two_ranks_comm_hidden_under_compute(tmp_path):
    gathered = run_ranks(_overlapped_rank, 2, timeout=90)
    assert [[(s.rank, s.name) for s in g] for g in gathered[1:]] == [[(s.rank, s.name) for s in gathered[0]]]
    spans = gathered[0]
    for rank in (0, 1):
        comm, = find(spans, name="dispatch", rank=rank)
        compute, = find(spans, name="experts", rank=rank)
        assert (comm.stream, comm.kind, comm.asynchronous, comm.meta) == (EP_COMM, "comm", True, {"mb": 0, "layer": 0})
        assert compute.stream == DEFAULT and compute.meta == {"mb": 1, "layer": 0}
        assert intersects(comm, compute), f"rank {rank}: the exchange did not run under the matmuls"
        assert metrics(spans).per_rank[rank].hidden_comm_time > 0

    path = tmp_path / "trace.json"
    Timeline().save_chrome_trace(str(path), spans=spans)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    assert sorted(set(threads.values())) == sorted({DEFAULT, EP_COMM})
    slices = [e for e in events if e["ph"] == "X"]
    assert sorted((e["pid"], threads[(e["pid"], e["tid"])], e["name"], e["cat"]) for e in slices) == [
        (0, DEFAULT, "experts", "compute"), (0, EP_COMM, "dispatch", "comm"),
        (1, DEFAULT, "experts", "compute"), (1, EP_COMM, "dispatch", "comm")]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert all(e["args"]["layer"] == 0 for e in slices)
    assert trace["otherData"]["generator"] == "npu-overlap"
    assert chrome_trace(spans) == trace

    png = tmp_path / "timeline.png"
    pytest.importorskip("matplotlib")
    save_png(spans, str(png), title="two ranks")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_issue_spans_are_host_time_not_busy_time():
    spans = [_span("attn", DEFAULT, "compute", 0.0, 4.0),
             _span("dispatch", EP_COMM, "issue", 4.0, 6.0),  # the host ran the operation, after the compute
             _span("dispatch", EP_COMM, "comm", 1.0, 3.0)]  # the exchange it issued, under the compute
    m = metrics(spans)
    assert m.busy(EP_COMM) == 2.0 and m.busy(DEFAULT) == 4.0
    assert m.ratio(DEFAULT, EP_COMM) == 1.0 and m.hidden_share == 1.0


def _mb_spans():
    """Two micro-batches: mb 0's exchange on ep_comm under mb 1's compute, issue spans, an unlabelled span."""
    spans = [_span("attn", DEFAULT, "compute", 0.0, 4.0), _span("attn", DEFAULT, "compute", 4.0, 8.0),
             _span("dispatch", EP_COMM, "issue", 3.9, 4.0), _span("dispatch", EP_COMM, "comm", 4.0, 7.5),
             _span("dispatch", EP_COMM, "issue", 7.9, 8.0), _span("dispatch", EP_COMM, "comm", 8.0, 8.05),
             _span("agree_split", DEFAULT, "comm", 8.1, 8.2)]
    for s, mb in zip(spans, (0, 1, 0, 0, 1, 1)):
        s.meta.update(mb=mb, layer=2)
    return spans


def test_png_colours_by_micro_batch_and_hatches_by_kind():
    from overlap.observability import _png

    attn0, attn1, issue0, comm0, _, comm1, agree = _mb_spans()
    style = _png.span_style
    assert style(attn0).colour == style(comm0).colour == style(issue0).colour  # micro-batch 0: one colour
    assert style(attn1).colour == style(comm1).colour != style(attn0).colour  # micro-batch 1: another
    assert style(agree).colour == _png.NO_MB not in (style(attn0).colour, style(attn1).colour)
    assert style(attn0).hatch == "" and style(comm0).hatch and style(issue0).hatch != style(comm0).hatch
    assert style(issue0).height < style(comm0).height  # host time drawn thin


def test_png_legend_names_micro_batches_and_every_kind():
    from overlap.observability import _png

    names = [name for name, _ in _png.legend_entries(_mb_spans())]
    assert names[:3] == ["micro-batch 0", "micro-batch 1", "no micro-batch"]
    assert [n.split()[0].rstrip(":") for n in names[3:]] == ["compute", "comm", "copy", "issue"]
    assert "no micro-batch" not in [n for n, _ in _png.legend_entries(_mb_spans()[:2])]
    odd = _span("x", DEFAULT, "wait", 0.0, 1.0)
    assert [n for n, _ in _png.legend_entries([odd])][-1] == "wait"  # a kind of another writer is named too


def test_png_labels_the_layer_where_it_fits():
    from overlap.observability import _png

    spans = _mb_spans()
    labels = {(s.meta["mb"], s.stream): text for s, text in _png.layer_labels(spans, min_width=1.0)}
    assert labels == {(0, DEFAULT): "L2", (1, DEFAULT): "L2", (0, EP_COMM): "L2"}  # mb 1's 0.05 s exchange: no room


def test_save_png_of_a_hand_built_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_png(_mb_spans(), str(tmp_path / "sub" / "t.png"), title="two-batch")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
