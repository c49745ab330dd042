"""``overlap-report FOLDER``: a folder of Chrome traces (torch.profiler's, one per rank, or the toolkit's) read as
its files one by one, per rank and merged; a folder holding nothing to read said in one line."""
import dataclasses
import gzip
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from overlap import Span
from overlap.observability.report import EXIT_BAD_INPUT, analyse, main
from overlap.observability.timeline import save_chrome_trace

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _bad(path, *words):
    """``overlap-report path`` exits 2 with one line holding ``words``."""
    result = _run(path)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for w in words:
        assert w in result.output, (w, result.output)


def _rank_trace(rank, comm_at_us):
    """A CPU-only torch.profiler trace of one rank as kineto writes it: host ops on the main thread, the gloo
    exchange on one of gloo's threads from ``comm_at_us`` for 400 us, a c10d op that only enqueues it."""
    pid, gloo = 1000 + rank, 2000 + rank
    base = 5_000_000_000.0 + 37 * rank  # each rank's own clock: only its own lanes are compared
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python3"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": gloo, "args": {"name": "pt_gloo_runloop"}}]
    for name, tid, at, dur in (("aten::mm", pid, 0, 300), ("aten::add", pid, 350, 250),
                               ("c10d::alltoall_base_", pid, 620, 20), ("gloo:all_to_all", gloo, comm_at_us, 400),
                               ("aten::relu", pid, 700, 200)):
        cat = "user_annotation" if name.startswith("gloo") else "cpu_op"
        events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": base + at, "dur": dur,
                       "args": {"External id": 1}})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2},
            "traceEvents": events}


def _profiler_folder(tmp_path):
    """Rank 0's trace as ``.pt.trace.json``, rank 1's gzip-compressed (``use_gzip=True``), the names
    tensorboard_trace_handler gives them; and the launcher's results.json, which is no trace."""
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "host_1000.1700000000000000000.pt.trace.json").write_text(json.dumps(_rank_trace(0, 200)))
    (folder / "host_1001.1700000000000000001.pt.trace.json.gz").write_bytes(
        gzip.compress(json.dumps(_rank_trace(1, 500)).encode()))
    (folder / "results.json").write_text(json.dumps({"rows": []}))
    return folder


def test_a_folder_of_per_rank_profiler_traces_is_read_as_its_files(tmp_path):
    folder = _profiler_folder(tmp_path)
    trace, m = analyse(str(folder))
    assert trace.format == "folder of 2 torch.profiler Chrome trace file(s)"
    assert [os.path.basename(f) for f in trace.files] == ["host_1000.1700000000000000000.pt.trace.json",
                                                          "host_1001.1700000000000000001.pt.trace.json.gz"]
    assert trace.left_out == ["results.json (no traceEvents: not a trace)"]
    comm = hidden = 0.0
    for f in trace.files:  # each rank's figures are the file's own
        _, alone = analyse(f)
        (name, rm), = alone.per_rank.items()
        assert m.per_rank[name] == rm
        comm, hidden = comm + rm.comm_time, hidden + rm.hidden_comm_time
    assert set(m.per_rank) == {"rank 0 process 1000", "rank 1 process 1001"}
    assert m.per_rank["rank 0 process 1000"].hidden_share == pytest.approx(0.875)  # 200..300, 350..600 of 200..600
    assert m.per_rank["rank 1 process 1001"].hidden_share == pytest.approx(0.75)  # 500..600, 700..900 of 500..900
    assert m.hidden_share == pytest.approx(hidden / comm) == pytest.approx(0.8125)  # merged: every rank pooled
    result = _run(folder, "--min-hidden", 0.8)
    assert result.exit_code == 0, result.output
    assert "rank 0 process 1000:" in result.output and "rank 1 process 1001:" in result.output
    assert "left out: results.json (no traceEvents: not a trace)" in result.output
    assert "all: hidden share of communication 81.2%" in result.output
    assert _run(folder, "--min-hidden", 0.85).exit_code == 1  # the merged figure is the gate's
    data = json.loads(_run(folder, "--json").output)
    assert len(data["files"]) == 2 and data["hidden_share"] == pytest.approx(0.8125)


def test_a_gzip_trace_is_read_as_its_content(tmp_path):
    plain = os.path.join(DATA, "torch_profiler_cuda.json")
    (tmp_path / "cuda.pt.trace.json.gz").write_bytes(gzip.compress(open(plain, "rb").read()))
    assert analyse(str(tmp_path / "cuda.pt.trace.json.gz"))[1] == analyse(plain)[1]


def test_the_same_process_in_two_files_is_told_apart_by_its_file(tmp_path):
    """Two profiles of one process (a profiler schedule that repeats, or two runs): each file's figures, under
    its process's name and the file's."""
    folder = tmp_path / "traces"
    for _ in range(2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder))):
            torch.randn(64, 64) @ torch.randn(64, 64)
    files = sorted(os.listdir(folder))
    assert len(files) == 2, files
    _, m = analyse(str(folder))
    for f in files:
        (name, rm), = analyse(str(folder / f))[1].per_rank.items()
        assert dataclasses.replace(m.per_rank[f"{name} ({f})"], rank=name) == rm
    assert len(m.per_rank) == 2


def test_a_folder_of_the_toolkits_per_rank_traces_matches_the_gathered_one(tmp_path):
    spans = [Span("attn", "default", "compute", 0, 0.0, 0.003), Span("dispatch", "ep_comm", "comm", 0, 0.002, 0.004),
             Span("attn", "default", "compute", 1, 0.0, 0.002), Span("dispatch", "ep_comm", "comm", 1, 0.001, 0.005)]
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in (0, 1):
        save_chrome_trace([s for s in spans if s.rank == rank], str(folder / f"trace_rank{rank}.json"))
    save_chrome_trace(spans, str(folder / "plan.json"), prediction={"schedule": "two-batch"})  # not a measurement
    trace, m = analyse(str(folder))
    assert trace.left_out == ["plan.json (a plan: predicted, not measured)"]
    _, gathered = analyse(save_chrome_trace(spans, str(tmp_path / "gathered.json")))
    assert m.per_rank == gathered.per_rank and m.hidden_share == gathered.hidden_share


def test_a_folder_with_nothing_to_read_says_what_it_looked_for(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a trace")
    _bad(empty, "empty: nothing to read here", "*.json", "*.json.gz", "torch.profiler", "trace_view.json",
         "ASCEND_PROFILER_OUTPUT")
    only = tmp_path / "only_results"
    only.mkdir()
    (only / "results.json").write_text(json.dumps({"rows": []}))
    _bad(only, "only_results: no trace among its 1 JSON file(s): results.json (no traceEvents: not a trace)")


def test_a_bad_file_in_a_folder_is_named_not_dropped(tmp_path):
    """A rank's unreadable trace would drop the rank from the merged figures: the report stops and names it."""
    folder = _profiler_folder(tmp_path)
    cut = folder / "host_1001.1700000000000000001.pt.trace.json.gz"
    cut.write_bytes(cut.read_bytes()[:-12])
    _bad(folder, cut.name, "damaged gzip")
    cut.write_text(json.dumps(_rank_trace(1, 500))[:200])
    _bad(folder, cut.name, "not valid JSON")
    cut.write_text(json.dumps({"traceEvents": []}))
    _bad(folder, cut.name, "no timed events")
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(_rank_trace(0, 200)))
    (folder / "b.json").mkdir()  # a folder named like a trace is no trace file
    assert _run(folder).exit_code == 0
