"""The overlap report CLI on small traces in every supported format, its gate and its errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from overlap import Span
from overlap.observability.report import EXIT_BAD_INPUT, EXIT_BELOW, analyse, main
from overlap.observability.timeline import save_chrome_trace

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


def _bad(path, *words):
    result = _run(path)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    for w in (os.path.basename(str(path)),) + words:
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
    proc = subprocess.run([sys.executable, "-m", "overlap.observability.report", path, "--min-overlap", "0.5"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_BELOW, proc.stderr
    assert "busy" in proc.stdout and "FAIL" in proc.stderr
