"""The overlap report CLI on small traces in every supported format, its gate and its errors."""
import gzip
import json
import os
import shutil
import sys

import pytest
from click.testing import CliRunner

from overlap import Span
from overlap.observability.report import EXIT_BAD_INPUT, EXIT_BELOW, analyse, main
from overlap.observability.timeline import save_chrome_trace
from support import zygote

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPU = os.path.join(DATA, "npu_prof")
RANK0 = os.path.join(NPU, "rank0_ascend_pt")


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _toolkit_trace(tmp_path, comm_start):
    """Rank 0: compute 0..3 ms on main, communication from comm_start for 2 ms on ep_comm; rank 1 idle comm."""
    spans = [Span("attn", "default", "compute", 0, 0.0, 0.003, meta={"mb": 0, "layer": 0}),
             Span("dispatch", "ep_comm", "comm", 0, comm_start, comm_start + 0.002, meta={"mb": 1}),
             Span("attn", "default", "compute", 1, 0.0, 0.001)]
    return save_chrome_trace(spans, str(tmp_path / "toolkit.json")), spans


def test_toolkit_trace_matches_timeline_metrics(tmp_path):
    from overlap.observability.timeline import metrics

    path, spans = _toolkit_trace(tmp_path, comm_start=0.0025)  # 0.5 ms of 2 ms under compute
    trace, m = analyse(path)
    assert trace.format == "overlap timeline"
    want = metrics(spans)
    got0, want0 = m.per_rank["rank 0"], want.per_rank[0]
    assert got0.busy == pytest.approx(want0.busy, abs=1e-9)
    assert got0.ratio("default", "ep_comm") == pytest.approx(want0.ratio("default", "ep_comm"), abs=1e-6)
    assert got0.hidden_share == pytest.approx(want0.hidden_share, abs=1e-6)
    result = _run(path)
    assert result.exit_code == 0
    assert "default | ep_comm" in result.output and "partial overlap" in result.output, result.output
    assert _run(path, "--min-overlap", 0.2).exit_code == 0
    assert _run(path, "--min-overlap", 0.3).exit_code == EXIT_BELOW


def test_serialized_toolkit_trace_fails_the_gate(tmp_path):
    path, _ = _toolkit_trace(tmp_path, comm_start=0.003)
    result = _run(path, "--min-overlap", 0.5)
    assert result.exit_code == EXIT_BELOW
    assert "serialized" in result.output
    assert "rank 0: overlap/min(busy) of default | ep_comm is 0.00 < 0.5" in result.output


def _issue_trace(tmp_path):
    """Rank 0 as the executor records it on CPU: compute 0..4 ms on main; on ep_comm the host's issue span
    of the dispatch 4..6 ms and the exchange it issued, in flight 1..3 ms under the compute."""
    spans = [Span("attn", "default", "compute", 0, 0.0, 0.004, meta={"mb": 1, "layer": 0}),
             Span("dispatch", "ep_comm", "issue", 0, 0.004, 0.006, meta={"mb": 0, "layer": 0}),
             Span("dispatch", "ep_comm", "comm", 0, 0.001, 0.003, meta={"mb": 0, "layer": 0})]
    return save_chrome_trace(spans, str(tmp_path / "issue.json")), spans


def test_issue_spans_are_no_busy_time(tmp_path):
    from overlap.observability.timeline import metrics

    path, spans = _issue_trace(tmp_path)
    for m, rank in ((analyse(path)[1], "rank 0"), (metrics(spans), 0)):  # the report and the timeline alike
        rm = m.per_rank[rank]
        assert rm.busy == pytest.approx({"default": 0.004, "ep_comm": 0.002}, abs=1e-9)  # the exchange only
        assert rm.ratio("default", "ep_comm") == pytest.approx(1.0)  # all of it under compute
        assert rm.hidden_share == pytest.approx(1.0)
    assert _run(path, "--min-overlap", 0.9).exit_code == 0
    # a stream that only the host touched is not busy at all
    host_only = save_chrome_trace(spans[:2], str(tmp_path / "host_only.json"))
    assert set(analyse(host_only)[1].per_rank["rank 0"].busy) == {"default"}


@pytest.mark.spawns_ranks
def test_the_report_prints_the_launchers_figures_on_its_own_trace(tmp_path):
    """``overlap-report`` on the launcher's two-batch trace: the launcher's hidden comm, and busy times
    without the host's issue spans (the two quantities related as `_intervals` says)."""
    from support.ports import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "launch", "prefill.py"), "--preset", "tiny", "--batch", "2", "--seq-len", "32",
           "--warmup", "0", "--iters", "3", "--out", str(tmp_path)]
    proc = zygote.run(cmd, timeout=240, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = str(tmp_path / "trace_two-batch.json")
    row = next(r for r in json.loads((tmp_path / "results.json").read_text())["rows"] if r["mode"] == "two-batch")
    _, m = analyse(trace)
    assert m.hidden_share == pytest.approx(row["hidden_comm_share"], abs=1e-4)
    table_row = next(line for line in proc.stdout.splitlines() if line.startswith("two-batch "))
    assert f"{row['hidden_comm_share']:.0%}" in table_row.split()
    events = json.loads(open(trace).read())["traceEvents"]
    assert any(e.get("cat") == "issue" for e in events)  # the executor's issue spans are in the trace
    for proc_name, rm in m.per_rank.items():
        assert rm.busy["ep_comm"] == pytest.approx(rm.comm_time, abs=1e-6), proc_name  # no issue time in it
        if set(rm.busy) == {"default", "ep_comm"}:  # all compute on one stream, all communication on the other
            low = min(rm.busy["default"], rm.comm_time)
            assert rm.ratio("default", "ep_comm") == pytest.approx(rm.hidden_comm_time / low, abs=1e-6)
    all_line = next(line for line in _run(trace).output.splitlines() if line.startswith("all: hidden share"))
    assert float(all_line.split()[5].rstrip("%")) == pytest.approx(100 * row["hidden_comm_share"], abs=0.06)
    assert "hidden comm" in all_line  # named as the launcher names it


def test_torch_profiler_cuda_trace():
    trace, m = analyse(os.path.join(DATA, "torch_profiler_cuda.json"))
    rm, = m.per_rank.values()
    assert set(rm.busy) == {"stream 7", "stream 13", "stream 21"}  # kernels and copies, not host ops
    assert rm.ratio("stream 7", "stream 13") == pytest.approx(0.8)
    assert rm.hidden_share == pytest.approx(0.8)
    assert rm.busiest_pair() == ("stream 13", "stream 7")
    result = _run(os.path.join(DATA, "torch_profiler_cuda.json"), "--min-overlap", 0.5)
    assert result.exit_code == 0 and "real overlap" in result.output


def test_torch_profiler_cpu_trace_uses_threads():
    trace, m = analyse(os.path.join(DATA, "torch_profiler_cpu.json"))
    rm, = m.per_rank.values()
    assert len(rm.busy) == 2 and all(s.startswith("thread ") for s in rm.busy)
    assert rm.comm_time > 0  # the gloo thread's all_to_all


def test_npu_folder_per_rank_and_gate():
    trace, m = analyse(NPU)
    assert trace.format == "torch_npu profiler folder"
    r0, r1 = m.per_rank["rank0_ascend_pt"], m.per_rank["rank1_ascend_pt"]
    assert r0.busy == pytest.approx({"Stream 2": 180e-6, "Stream 5": 100e-6})  # the EVENT_WAIT is not work
    assert r0.ratio("Stream 2", "Stream 5") == pytest.approx(0.8)
    assert r1.ratio("Stream 2", "Stream 5") == 0.0  # from kernel_details.csv
    assert r0.hidden_share == pytest.approx(0.8) and r1.hidden_share == 0.0
    comm, hidden = trace.profiler_overlap["rank0_ascend_pt"]  # step_trace_time.csv
    assert hidden / comm == pytest.approx(0.8)
    result = _run(NPU, "--min-overlap", 0.5)
    assert result.exit_code == EXIT_BELOW and "rank1_ascend_pt" in result.output
    assert _run(RANK0, "--min-overlap", 0.5, "--pair", "Stream 2", "Stream 5").exit_code == 0
    assert _run(RANK0, "--min-hidden", 0.9).exit_code == EXIT_BELOW
    data = json.loads(_run(NPU, "--json").output)
    assert data["ranks"]["rank0_ascend_pt"]["pairs"][0]["verdict"] == "real overlap"


def test_npu_files_directly():
    out = os.path.join(RANK0, "ASCEND_PROFILER_OUTPUT")
    _, m = analyse(os.path.join(out, "trace_view.json"))
    assert m.ratio("Stream 2", "Stream 5") == pytest.approx(0.8)
    kd = os.path.join(NPU, "rank1_ascend_pt", "ASCEND_PROFILER_OUTPUT", "kernel_details.csv")
    _, m = analyse(kd)
    assert m.busy("Stream 2") == pytest.approx(150e-6)
    trace, _ = analyse(os.path.join(out, "step_trace_time.csv"))
    assert trace.profiler_overlap


def test_npu_trace_view_is_read_as_msprof_writes_it(tmp_path):
    """Ascend Hardware tasks carry 'Physic Stream Id' (no 'Stream Id'), and 'ts' strings in microseconds."""
    from overlap.observability._traces import load

    view = os.path.join(RANK0, "ASCEND_PROFILER_OUTPUT", "trace_view.json")
    events = json.load(open(view))
    hardware = [e for e in events if e.get("pid") == 2001 and e.get("ph") == "X"]
    assert hardware and all("Stream Id" not in e["args"] and e["args"]["Physic Stream Id"] == e["tid"]
                            and isinstance(e["ts"], str) for e in hardware)
    # no thread names: the lanes still come from the physical stream of each task
    (tmp_path / "trace_view.json").write_text(json.dumps([e for e in events if e.get("name") != "thread_name"]))
    items = load(str(tmp_path / "trace_view.json")).items
    assert {stream for _, stream, _, _, _ in items} == {"Stream 2", "Stream 5"}


def test_every_task_of_an_hccl_stream_is_communication():
    """HCCL runs SDMA / Memcpy / Reduce_Inline / Notify tasks on its stream: communication, not compute."""
    from overlap.observability._traces import load

    items = load(os.path.join(RANK0, "ASCEND_PROFILER_OUTPUT", "trace_view.json")).items
    kinds = {}
    for _, stream, kind, start, end in items:
        kinds.setdefault(stream, []).append((kind, round((end - start) * 1e6)))
    assert kinds["Stream 5"] == [("comm", 10), ("comm", 20), ("comm", 40), ("comm", 20), ("comm", 10)]
    assert {k for k, _ in kinds["Stream 2"]} == {"compute"}
    _, m = analyse(NPU)
    assert m.per_rank["rank0_ascend_pt"].comm_time == pytest.approx(100e-6)  # the EVENT_WAIT left out


def test_kernel_details_hccl_stream_is_communication(tmp_path):
    csv = ("Step Id,Name,Type,Stream ID,Accelerator Core,Start Time(us),Duration(us)\n"
           "0,MatMulV2,MatMulV2,2,AI_CORE,0,100\n"
           "0,hcom_allReduce__1_0_1,hcom_allReduce_,7,HCCL,0,10\n"
           "0,Memcpy,MEMCPY_ASYNC,7,SDMA,10,40\n"
           "0,Cast,Cast,2,AI_VECTOR_CORE,100,10\n")
    (tmp_path / "kernel_details.csv").write_text(csv)
    _, m = analyse(str(tmp_path / "kernel_details.csv"))
    rm, = m.per_rank.values()
    assert rm.comm_time == pytest.approx(50e-6)
    assert rm.hidden_share == pytest.approx(1.0)


def _bad(path, *words, args=(), names_file=True):
    """``overlap-report path *args`` exits 2 with one line naming the file and holding ``words``."""
    result = _run(path, *args)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for w in (os.path.basename(os.path.normpath(str(path))),) * names_file + words:
        assert w in result.output, (w, result.output)


def test_bad_inputs_name_file_and_problem(tmp_path):
    full = open(os.path.join(DATA, "torch_profiler_cuda.json")).read()
    (tmp_path / "cut.json").write_text(full[: len(full) // 2])
    _bad(tmp_path / "cut.json", "not valid JSON", "truncated")
    (tmp_path / "nothing.json").write_text(json.dumps({"foo": 1}))
    _bad(tmp_path / "nothing.json", "traceEvents")
    (tmp_path / "nodur.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "k", "ts": 1}]}))
    _bad(tmp_path / "nodur.json", "'dur'", "'k'")
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    _bad(tmp_path / "empty.json", "no timed events")
    _bad(tmp_path / "missing.json", "no such file")
    (tmp_path / "kernel_details.csv").write_text("Step Id,Name,Type,Start Time(us),Duration(us)\n0,Mm,AI_CORE,1,2\n")
    _bad(tmp_path / "kernel_details.csv", "Stream ID", "Level1")
    (tmp_path / "step_trace_time.csv").write_text("Step,Computing\n0,1\n")
    _bad(tmp_path / "step_trace_time.csv", "Communication")
    folder = tmp_path / "prof"
    folder.mkdir()
    _bad(folder, "ASCEND_PROFILER_OUTPUT")
    out = folder / "x_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    shutil.copytree(os.path.join(RANK0, "ASCEND_PROFILER_OUTPUT"), out)
    view = json.load(open(out / "trace_view.json"))
    view = [e for e in view if e.get("args", {}).get("name") != "Ascend Hardware"]
    (out / "trace_view.json").write_text(json.dumps(view))
    _bad(folder, "trace_view.json", "Ascend Hardware")
    assert _run(tmp_path / "kernel_details.csv", "--min-overlap", 2).exit_code == 2  # click rejects the range


def test_module_entry_point(tmp_path):
    path, _ = _toolkit_trace(tmp_path, comm_start=0.003)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = zygote.run([sys.executable, "-m", "overlap.observability.report", path, "--min-overlap", "0.5"], env=env,
                      timeout=120)
    assert proc.returncode == EXIT_BELOW, proc.stderr
    assert "busy" in proc.stdout and "FAIL" in proc.stderr


def _kernel(name, tid, ts, dur, **extra):
    return dict({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur,
                 "args": {"stream": tid}}, **extra)


GOOD = [_kernel("gemm", 7, 0, 100), _kernel("ncclAllToAll", 13, 50, 100)]


def _trace(events, **top):
    return json.dumps(dict({"traceEvents": events}, **top)).encode()


@pytest.mark.parametrize("content, words", [
    (bytes(range(256)) * 4, ["not a trace", "binary"]),
    (_trace(GOOD) + b"\x00\x00", ["binary", "NUL"]),
    (gzip.compress(_trace(GOOD))[:-12], ["not a trace", "damaged gzip"]),
    (gzip.compress(b""), ["empty file"]),
    (b"", ["empty file"]),
    (b" \n\t\n", ["empty file"]),
    (b"[1, 2, 3]", ["not a trace", "event 0", "not an object"]),
    (b'"a trace"', ["not a trace", "traceEvents", "a string"]),
    (b"42", ["not a trace", "a number"]),
    (b"null", ["not a trace", "null"]),
    (b'{"events": []}', ["not a trace", "traceEvents", "'events'"]),
    (b'{"traceEvents": {"ph": "X"}}', ["not a trace", "traceEvents"]),
    (_trace(GOOD + ["X"]), ["not a trace", "event 2", "not an object"]),
    (_trace(GOOD + [None]), ["not a trace", "event 2", "not an object"]),
    (_trace([{"ph": "M", "name": "process_name", "pid": 0, "args": "gpu"}] + GOOD), ["'args' of event 0", "'gpu'"]),
    (_trace([{"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": None}] + GOOD), ["'args' of event 0"]),
    (_trace([GOOD[0], dict(GOOD[1], args=[13])]), ["'args' of event 1", "not an object"]),
    (_trace([GOOD[0], dict(GOOD[1], pid=[0])]), ["'pid' of event 1"]),
    (_trace([dict(GOOD[0], tid={"id": 7}), GOOD[1]]), ["'tid' of event 0"]),
    (b"[" * 100000 + b"]" * 100000, ["not a trace", "nested too deeply"]),
    (b'{"traceEvents": [{"ph": "X", "ts": ' + b"1" * 5000 + b', "dur": 1}]}', ["not valid JSON", "digits"]),
], ids=["binary", "nul-bytes", "gzip-cut", "gzip-empty", "empty", "blank", "list-of-numbers", "string", "number", "null",
        "no-traceEvents", "traceEvents-object", "event-string", "event-null", "args-string", "args-null", "args-list",
        "pid-list", "tid-object", "deeply-nested", "huge-integer"])
def test_not_a_trace(tmp_path, content, words):
    (tmp_path / "trace.json").write_bytes(content)
    _bad(tmp_path / "trace.json", *words)


def test_odd_optional_metadata_is_ignored(tmp_path):
    (tmp_path / "trace.json").write_bytes(_trace(GOOD, otherData=3, distributedInfo="rank 0"))
    result = _run(tmp_path / "trace.json")
    assert result.exit_code == 0 and "stream 13 | stream 7: overlap 0.050 ms" in result.output, result.output


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("first, second, words", [
    (dict(ts=NAN), {}, ["'ts' of event 0", "not a finite number"]),
    (dict(ts=INF), {}, ["'ts' of event 0", "not a finite number"]),
    ({}, dict(ts=-INF), ["'ts' of event 1", "not a finite number"]),
    (dict(ts="nan"), {}, ["'ts' of event 0", "'nan', not a number"]),
    ({}, dict(ts="12"), ["'ts' of event 1 ('ncclAllToAll')", "'12', not a number"]),
    (dict(dur="100"), {}, ["'dur' of event 0 ('gemm')", "'100', not a number"]),
    ({}, dict(ts=True), ["'ts' of event 1 ('ncclAllToAll')", "True, not a number"]),
    (dict(dur=-5), {}, ["'dur' of event 0", "negative"]),
    ({}, dict(dur=NAN), ["'dur' of event 1", "not a finite number"]),
    ({}, dict(dur=INF), ["'dur' of event 1", "not a finite number"]),
    (dict(dur=1e20), {}, ["'dur' of event 0", "2**53"]),
    (dict(dur=1e308), dict(dur=1e308), ["'dur' of event 0", "2**53"]),
    ({}, dict(ts=1e16), ["'ts' of event 1", "2**53"]),
    (dict(ts=-1e308), dict(ts=1e308), ["'ts' of event 1", "2**53"]),
], ids=["ts-nan", "ts-inf", "ts-minus-inf", "ts-nan-string", "ts-string", "dur-string", "ts-bool", "dur-negative", "dur-nan", "dur-inf", "dur-huge",
        "dur-overflow", "ts-far", "ts-overflow"])
def test_bad_times_in_json(tmp_path, first, second, words):
    (tmp_path / "trace.json").write_bytes(_trace([dict(GOOD[0], **first), dict(GOOD[1], **second)]))
    _bad(tmp_path / "trace.json", *words)


def test_the_hidden_share_does_not_depend_on_the_origin_or_the_order_of_events(tmp_path):
    """A trace shifted by a constant (to negative times) and with its events reversed is the same timeline: the
    same figures (an answer that depended on the first event's time or on the events' order would differ)."""
    path, _ = _toolkit_trace(tmp_path, comm_start=0.0025)
    data = json.load(open(path))
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            e["ts"] -= 10 ** 6
    data["traceEvents"].reverse()
    (tmp_path / "moved.json").write_text(json.dumps(data))
    want, got = _run(path), _run(tmp_path / "moved.json")
    assert want.exit_code == got.exit_code == 0, got.output
    assert analyse(str(tmp_path / "moved.json"))[1].per_rank["rank 0"].hidden_share == pytest.approx(
        analyse(path)[1].per_rank["rank 0"].hidden_share, abs=1e-9)
    assert got.output.replace("moved.json", "toolkit.json") == want.output


def test_bad_times_in_every_json_reader(tmp_path):
    path, _ = _toolkit_trace(tmp_path, comm_start=0.0025)
    data = json.load(open(path))
    x = [i for i, e in enumerate(data["traceEvents"]) if e["ph"] == "X"][1]
    data["traceEvents"][x]["ts"] = NAN
    (tmp_path / "toolkit.json").write_text(json.dumps(data))
    _bad(tmp_path / "toolkit.json", f"'ts' of event {x}", "not a finite number")
    view = json.load(open(os.path.join(RANK0, "ASCEND_PROFILER_OUTPUT", "trace_view.json")))
    x = [i for i, e in enumerate(view) if e.get("ph") == "X"][0]
    view[x]["dur"] = -1
    (tmp_path / "trace_view.json").write_text(json.dumps(view))
    _bad(tmp_path / "trace_view.json", f"'dur' of event {x}", "negative")


KERNEL_HEADER = "Step Id,Name,Type,Stream ID,Start Time(us),Duration(us)\n"


@pytest.mark.parametrize("name, text, words", [
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,1,2\n0,Add,AI_CORE,2,nan,2\n",
     ["'Start Time(us)' on line 3", "not a finite number"]),
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,inf,2\n", ["'Start Time(us)' on line 2", "finite"]),
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,1,-2\n", ["'Duration(us)' on line 2", "negative"]),
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,1,Infinity\n", ["'Duration(us)' on line 2", "finite"]),
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,0,2\n0,Add,AI_CORE,5,1e16,2\n",
     ["'Start Time(us)' on line 3", "2**53"]),
    ("kernel_details.csv", KERNEL_HEADER + "0,Mm,AI_CORE,2,1,2,oops\n", ["line 2", "7 cells",
     "malformed CSV"]),
    ("kernel_details.csv", "", ["empty file"]),
    ("kernel_details.csv", "\x00" * 8 + KERNEL_HEADER, ["binary", "NUL"]),
    ("step_trace_time.csv", "Step,Communication,Communication(Not Overlapped)\n0,nan,1\n",
     ["'Communication' on line 2", "not a finite number"]),
    ("step_trace_time.csv", "Step,Communication,Communication(Not Overlapped)\n0,5,-1\n",
     ["'Communication(Not Overlapped)' on line 2", "negative"]),
    ("step_trace_time.csv", "Step,Communication,Communication(Not Overlapped)\n0,5,1\n1,5,7\n",
     ["'Communication(Not Overlapped)' on line 3", "more than 'Communication'"]),
    ("step_trace_time.csv", "", ["empty file"]),
], ids=["start-nan", "start-inf", "duration-negative", "duration-inf", "start-far", "extra-cell", "empty",
        "nul-bytes", "step-nan", "step-negative", "step-exposed-over-total", "step-empty"])
def test_bad_csv(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    _bad(tmp_path / name, *words)


def test_binary_csv(tmp_path):
    (tmp_path / "kernel_details.csv").write_bytes(bytes(range(128, 256)) * 8)
    _bad(tmp_path / "kernel_details.csv", "not a trace", "binary")


def test_trailing_empty_csv_cells_are_fine(tmp_path):
    (tmp_path / "kernel_details.csv").write_text(KERNEL_HEADER + "0,Mm,AI_CORE,2,1,2,,\n")
    assert _run(tmp_path / "kernel_details.csv").exit_code == 0


def _npu_copy(tmp_path):
    root = tmp_path / "prof"
    shutil.copytree(NPU, root)
    return root


def test_npu_folder_with_a_rank_missing_its_files(tmp_path):
    root = _npu_copy(tmp_path)
    (root / "rank2_ascend_pt" / "ASCEND_PROFILER_OUTPUT").mkdir(parents=True)
    _bad(root, "rank2_ascend_pt", "ASCEND_PROFILER_OUTPUT", "trace_view.json")
    (root / "rank2_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_2.db").write_bytes(b"SQLite")
    _bad(root, "rank2_ascend_pt", ".db")
    shutil.rmtree(root / "rank2_ascend_pt" / "ASCEND_PROFILER_OUTPUT")
    (root / "rank2_ascend_pt" / "PROF_000001").mkdir()
    _bad(root, "rank2_ascend_pt", "without an ASCEND_PROFILER_OUTPUT", "not parsed")
    empty = tmp_path / "ASCEND_PROFILER_OUTPUT"
    empty.mkdir()
    _bad(empty, "ASCEND_PROFILER_OUTPUT", "kernel_details.csv")


def test_npu_folder_with_a_binary_trace_view(tmp_path):
    root = _npu_copy(tmp_path)
    (root / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").write_bytes(bytes(range(128, 256)))
    _bad(root, "trace_view.json", "binary")


def test_npu_folder_that_cannot_be_listed(tmp_path, monkeypatch):
    root = _npu_copy(tmp_path)
    locked = str(root / "rank1_ascend_pt")
    if os.geteuid() == 0:  # root reads anything: make listing that folder fail as it would for a user
        scandir = os.scandir

        def denied(path="."):
            if os.path.abspath(path) == locked:
                raise PermissionError(13, "Permission denied", path)
            return scandir(path)

        monkeypatch.setattr(os, "scandir", denied)
    else:
        os.chmod(locked, 0)
    try:
        _bad(root, "rank1_ascend_pt", "cannot read it", "Permission denied")
    finally:
        os.chmod(locked, 0o755)


def test_only_zero_length_spans(tmp_path):
    (tmp_path / "trace.json").write_bytes(_trace([dict(GOOD[0], dur=0), dict(GOOD[1], dur=0)]))
    _bad(tmp_path / "trace.json", "zero duration")
    _bad(tmp_path / "trace.json", "zero duration", args=("--min-overlap", 0.5))


def test_bad_gate_options(tmp_path):
    path = os.path.join(DATA, "torch_profiler_cuda.json")
    for option in ("--min-overlap", "--min-hidden"):
        result = _run(path, option, "nan")
        assert result.exit_code == EXIT_BAD_INPUT and "nan" in result.output, result.output
    _bad(path, "--pair", "twice", args=("--min-overlap", 0.5, "--pair", "stream 7", "stream 7"), names_file=False)
    _bad(path, "--pair", "--min-overlap", args=("--pair", "stream 7", "stream 99"), names_file=False)
    _bad(path, "stream 99", "stream 13", args=("--min-overlap", 0.5, "--pair", "stream 7", "stream 99"),
         names_file=False)


def test_reader_bug_is_bad_input_not_a_gate_failure(tmp_path, monkeypatch):
    from overlap.observability import report

    def broken(source):
        raise KeyError("surprise\nsecond line")

    monkeypatch.setattr(report, "load", broken)
    path, _ = _toolkit_trace(tmp_path, comm_start=0.0025)
    _bad(path, "KeyError", "surprise", "bug")


def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    (tmp_path / "nan.json").write_bytes(_trace([dict(GOOD[0], ts=NAN), GOOD[1]]))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("binary.json", "nan.json"):
        proc = zygote.run([sys.executable, "-m", "overlap.observability.report", str(tmp_path / name),
                           "--min-overlap", "0.5"], env=env, timeout=120)
        assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert name in proc.stderr and "Traceback" not in proc.stderr


# ---- --plan: a measured trace against a predicted one -------------------------------------------------


def _plan_traces(tmp_path):
    """Rank 0 measured and planned (ms): the exchange of mb0 runs 4.5 ms longer than planned, so experts start later."""
    def at(name, stream, kind, start_ms, end_ms, mb, rank=0, origin=0.0):
        return Span(name, stream, kind, rank, origin + start_ms * 1e-3, origin + end_ms * 1e-3,
                    meta={"mb": mb, "layer": 1})

    measured = [at("attn", "default", "compute", 0, 4, 0, origin=50.0),
                at("dispatch", "ep_comm", "issue", 4, 5, 0, origin=50.0),
                at("dispatch", "ep_comm", "comm", 4.5, 12, 0, origin=50.0),
                at("attn", "default", "compute", 5, 9, 1, origin=50.0),
                at("experts", "default", "compute", 12, 14.2, 0, origin=50.0),
                at("attn", "default", "compute", 1, 4, 0, rank=1, origin=50.0)]  # rank 1 was not planned
    planned = [at("attn", "default", "compute", 0, 4, 0), at("dispatch", "ep_comm", "issue", 4, 4.5, 0),
               at("dispatch", "ep_comm", "comm", 4.5, 7.5, 0), at("attn", "default", "compute", 4.5, 8.5, 1),
               at("experts", "default", "compute", 8.5, 10.5, 0),
               at("dispatch.counts", "ep_comm", "comm", 10.5, 11, 0)]  # a transfer the run did not make
    return (save_chrome_trace(measured, str(tmp_path / "measured.json")),
            save_chrome_trace(planned, str(tmp_path / "plan.json"), prediction={"schedule": "two-batch"}))


def test_plan_compares_measured_with_predicted(tmp_path):
    measured, plan = _plan_traces(tmp_path)
    result = _run(measured, "--plan", plan)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "length: measured 14.200 ms, predicted 11.000 ms (measured / predicted 1.29x)" in out, out
    row = next(line for line in out.splitlines() if line.startswith("0") and "dispatch (comm)" in line)
    assert row.split()[-4:] == ["7.500", "3.000", "4.500", "4.500"], row  # durations, then starts
    top_duration = out.split("largest duration drift")[1].split("largest start drift")[0].strip().splitlines()
    assert "dispatch (comm) mb0 L1 @ep_comm: +4.500 ms" in top_duration[1], top_duration
    top_start = out.split("largest start drift")[1].strip().splitlines()
    assert "experts (compute) mb0 L1 @default: +3.500 ms" in top_start[1], top_start
    assert len(top_duration) == 6 and "unmatched: 1 measured span(s), 1 planned span(s)" in out

    data = json.loads(_run(measured, "--plan", plan, "--json").output)
    assert data["measured_s"] == pytest.approx(14.2e-3) and data["predicted_s"] == pytest.approx(11e-3)
    ops = {(o["name"], o["kind"], o["mb"]): o for o in data["operations"]}
    assert len(ops) == 5 and ops["dispatch", "issue", 0]["measured_s"] == pytest.approx(1e-3)
    assert ops["attn", "compute", 1]["start_drift_s"] == pytest.approx(0.5e-3)
    assert [(o["name"], o["kind"]) for o in data["top_duration_drift"]][:3] == [
        ("dispatch", "comm"), ("dispatch", "issue"), ("experts", "compute")]
    assert data["top_start_drift"][0]["name"] == "experts" and len(data["top_start_drift"]) == 5
    assert [s["name"] for s in data["only_measured"]] == ["attn"] and data["only_measured"][0]["rank"] == 1
    assert [s["name"] for s in data["only_planned"]] == ["dispatch.counts"]


def _predicted(mode, n_layers=2, names=("attn", "send", "fin"), tokens=(16, 16)):
    from microbatch import CostModel, Interconnect, Linear, OpCost, Operation, Transfer, predict

    attn, send, fin = names
    layers = [[Operation(attn, None, ("hidden",), ("x",)), Operation(send, None, ("x",), ("y",), "ep_comm"),
               Operation(fin, None, ("y",), ("out",))]] * n_layers
    costs = CostModel({attn: OpCost(Linear(1e-3)), fin: OpCost(Linear(2e-4)),
                       send: OpCost(Linear(1e-4), (Transfer(send, Linear(1e4)),))}, Interconnect(1e-4, 1e-9))
    return predict(mode, layers, list(tokens), costs)


def test_plan_of_a_simulated_prediction_matches_its_spans(tmp_path):
    prediction = _predicted("two-batch")
    plan = prediction.save_chrome_trace(str(tmp_path / "plan.json"))
    assert json.load(open(plan))["otherData"]["prediction"]["schedule"] == "two-batch"
    measured = save_chrome_trace(prediction.spans, str(tmp_path / "measured.json"))  # as if measured exactly so
    data = json.loads(_run(measured, "--plan", plan, "--json").output)
    assert len(data["operations"]) == 2 * 2 * 4 and not data["only_measured"] and not data["only_planned"]
    assert all(o["duration_drift_s"] == 0 and o["start_drift_s"] == 0 for o in data["operations"])


def test_plan_must_be_a_plan_of_the_measured_schedule(tmp_path):
    """A measured trace given as the plan, a plan given as the measured trace, or a plan of another mode,
    micro-batch count, layer count or model is refused in one line naming what differs (before: a drift
    table and a "measured / predicted" ratio between two different runs, with only an unmatched count)."""
    plan = _predicted("two-batch").save_chrome_trace(str(tmp_path / "plan.json"))

    def measured(name, prediction):
        return save_chrome_trace(prediction.spans, str(tmp_path / name))

    two = measured("two.json", _predicted("two-batch"))
    assert _run(two, "--plan", plan).exit_code == 0
    _bad(two, "two.json", "not a plan", "measured", args=("--plan", two), names_file=False)
    _bad(plan, "a plan", "not a measured one", args=("--plan", plan))
    _bad(measured("serial.json", _predicted("serial", tokens=(32,))), "(two-batch)", "micro-batches",
         "measured 1 (mb0), planned 2 (mb0, mb1)", args=("--plan", plan))
    _bad(measured("three.json", _predicted("two-batch", n_layers=3)), "layers", "measured 3 (L0-L2), planned 2",
         args=("--plan", plan))
    _bad(measured("model.json", _predicted("two-batch", names=("attn", "send", "mlp"))), "operations",
         "only measured: mlp", "only planned: fin", args=("--plan", plan))
    serial_split = _predicted("serial", tokens=(32,)).save_chrome_trace(str(tmp_path / "serial_split.json"))
    _bad(measured("shared.json", _predicted("shared", tokens=(32,))), "(serial)", "streams",
         "send of mb0 L0 runs on ep_comm measured, on default planned", args=("--plan", serial_split))
    twice = _predicted("two-batch")
    _bad(save_chrome_trace(twice.spans + twice.spans[:1], str(tmp_path / "twice.json")), "launches", "2 time(s)",
         args=("--plan", plan))
    (tmp_path / "array.json").write_text(json.dumps(json.load(open(two))["traceEvents"]))
    _bad(two, "array.json", "not a plan", "JSON array format", args=("--plan", tmp_path / "array.json"),
         names_file=False)
    assert _run(tmp_path / "array.json", "--plan", plan).exit_code == 0  # a measured trace may be an array


def test_toolkit_trace_in_the_json_array_format(tmp_path):
    """Chrome's other layout, a bare array of events, with no otherData (before: "no timed events found")."""
    path, spans = _toolkit_trace(tmp_path, comm_start=0.0025)
    (tmp_path / "array.json").write_text(json.dumps(json.load(open(path))["traceEvents"]))
    trace, m = analyse(str(tmp_path / "array.json"))
    assert trace.format == "overlap timeline, JSON array format"
    assert m == analyse(path)[1] and m.per_rank["rank 0"].busy == pytest.approx({"default": 3e-3, "ep_comm": 2e-3})
    other = [dict(e, cat="other") for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    (tmp_path / "other.json").write_text(json.dumps(other))
    _bad(tmp_path / "other.json", "3 complete slices, none the report can place")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_or_a_device_is_refused_not_waited_on(tmp_path):
    """A pipe with no writer blocked the report forever; only regular files and folders are read."""
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    path, _ = _toolkit_trace(tmp_path, comm_start=0.0025)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for args, named in (([fifo], fifo), ([path, "--plan", fifo], fifo), ([os.devnull], os.devnull)):
        proc = zygote.run([sys.executable, "-m", "overlap.observability.report"] + [str(a) for a in args],
                          env=env, timeout=120)
        assert proc.returncode == EXIT_BAD_INPUT and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert str(named) in proc.stderr and "not a regular file or a folder" in proc.stderr, proc.stderr
    _bad(path, "a folder, not a trace file", args=("--plan", tmp_path), names_file=False)


def test_plan_bad_inputs_are_one_line(tmp_path):
    measured, plan = _plan_traces(tmp_path)
    _bad(measured, "missing.json", "No such file", args=("--plan", tmp_path / "missing.json"), names_file=False)
    _bad(measured, "torch_profiler_cuda.json", "not a trace of this toolkit",
         args=("--plan", os.path.join(DATA, "torch_profiler_cuda.json")), names_file=False)
    _bad(os.path.join(DATA, "torch_profiler_cuda.json"), "not a trace of this toolkit", args=("--plan", plan))
    _bad(measured, "--plan", "--min-overlap", args=("--plan", plan, "--min-overlap", 0.5), names_file=False)
    (tmp_path / "cut.json").write_text(open(plan).read()[:100])
    _bad(measured, "cut.json", "not valid JSON", args=("--plan", tmp_path / "cut.json"), names_file=False)
    other = save_chrome_trace([Span("gemm", "default", "compute", 3, 0.0, 1.0)], str(tmp_path / "other.json"),
                              prediction={})
    _bad(measured, "no span matches", "other.json", args=("--plan", other))
