"""``overlap-report --points``: per parallel point the side and dominator windows, overlap_pct, the verdict and the
barrier, on crafted traces with known windows (no time is asserted on measured ones), and its gate and errors."""
import json
import os

import pytest
from click.testing import CliRunner

import overlap
from overlap import Span
from overlap.observability._points import FALSE, PARTIAL, REAL, overlap_pct, point_verdict, toolkit_points
from overlap.observability._traces import named_tasks
from overlap.observability.report import EXIT_BAD_INPUT, EXIT_BELOW, main
from overlap.observability.timeline import save_chrome_trace

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHIPPED = os.path.join(DATA, "shared_tiny_timeline.json")  # a shared-mode prefill of the tiny reference model, CPU


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("side, dominator, pct, verdict", [
    ((0, 10), (5, 25), 0.5, REAL),  # half of the side window under the dominator: real, at the edge
    ((0, 20), (19, 39), 0.05, FALSE),  # 1 of 20: false, at the edge
    ((0, 20), (18, 38), 0.1, PARTIAL),
    ((0, 4), (0, 100), 1.0, REAL),  # the shorter window decides
    ((10, 20), (0, 10), 0.0, FALSE),  # back to back
])
def test_overlap_pct_and_verdict_at_the_thresholds(side, dominator, pct, verdict):
    assert overlap_pct(side, dominator) == pytest.approx(pct)
    assert point_verdict(overlap_pct(side, dominator)) == verdict


def _op(name, stream, start, end, reads, writes, layer=0, mb=0):
    return Span(name, stream, "compute", 0, start, end,
                meta={"mb": mb, "layer": layer, "op": name, "reads": reads, "writes": writes})


def _false_point(tmp_path):
    """The guide's false point: the side stream's ``z`` consumed by a cheap ``silu`` on the main stream ahead of the
    dominator, which therefore starts only after the side stream ended."""
    spans = [_op("norm", "default", 0.000, 0.001, "hidden", "x"),
             _op("shared", "shared_expert", 0.001, 0.004, "x", "z"),
             _op("silu", "default", 0.004, 0.0041, "z", "act"),
             _op("matmul", "default", 0.0041, 0.009, "x", "y"),
             _op("out", "default", 0.009, 0.0095, "y,act", "out")]
    return save_chrome_trace(spans, str(tmp_path / "false_point.json"))


def test_a_false_point_names_its_dominator_and_barrier(tmp_path):
    path = _false_point(tmp_path)
    (occ,) = toolkit_points(named_tasks(path)[1])
    assert (occ.point, occ.dominator, occ.verdict, occ.barrier) == ("L0.mb0.shared@shared_expert", "matmul", FALSE,
                                                                    "silu")
    assert occ.side == pytest.approx((0.001, 0.004)) and occ.dominator_window == pytest.approx((0.0041, 0.009))
    r = _run(path, "--points")
    assert r.exit_code == 0, r.output
    assert "dominator matmul [4100.00, 9000.00] us  overlap_pct 0.00  false  barrier: silu" in r.output


def test_a_real_point_has_no_barrier_and_ops_on_its_data_path_are_no_dominator(tmp_path):
    spans = [_op("norm", "default", 0.000, 0.001, "hidden", "x"),
             _op("shared", "shared_expert", 0.001, 0.004, "x", "z"),
             _op("matmul", "default", 0.001, 0.006, "x", "y"),
             _op("silu", "default", 0.006, 0.0061, "z", "act"),  # consumes z after the dominator: no barrier
             _op("longest", "default", 0.0061, 0.02, "y,act", "out")]  # reads z's consumer: not its dominator
    path = save_chrome_trace(spans, str(tmp_path / "real.json"))
    (occ,) = toolkit_points(named_tasks(path)[1])
    assert (occ.dominator, occ.overlap_pct, occ.verdict, occ.barrier) == ("matmul", 1.0, REAL, None)


def test_the_gate_fails_naming_each_point_below_the_floor(tmp_path):
    path = _false_point(tmp_path)
    r = _run(path, "--points", "--min-point-overlap", 0.5)
    assert r.exit_code == EXIT_BELOW
    assert "FAIL: point L0.mb0.shared@shared_expert: overlap_pct 0.00 < 0.5" in r.output
    assert _run(path, "--points", "--min-point-overlap", 0).exit_code == 0


def test_the_shipped_shared_mode_trace_has_the_shared_expert_point_with_its_dominator():
    occ = {o.point: o for o in toolkit_points(named_tasks(SHIPPED)[1])}
    assert occ["L1.mb0.shared_gate_up@shared_expert"].dominator == "experts"
    assert occ["L1.mb0.dispatch@ep_comm"].dominator is None  # the routed experts read what it sends


def test_a_shared_mode_run_carries_its_data_flow_and_its_shared_expert_point(tmp_path):
    from launch.engine import make_expert_parallel, prefill, split_for
    from launch.models import build_model, preset
    from microbatch.batch import Batch

    cfg = preset("tiny", n_layers=2, n_dense_layers=1)
    batch = Batch.random([9, 7], cfg.vocab, seed=0)
    model = make_expert_parallel(build_model(cfg, seed=5), None)
    with overlap.Timeline() as tl:
        prefill(model, batch, "shared", split_for("shared", batch, None, min_tokens=4))
        overlap.synchronize()
    (experts,) = tl.find(name="experts", layer=1)
    assert (experts.meta["reads"], experts.meta["writes"]) == ("moe_dispatch", "moe_expert_out,moe_expert_batch")
    path = tl.save_chrome_trace(str(tmp_path / "shared.json"))
    occ = {o.point: o for o in toolkit_points(named_tasks(path)[1])}
    assert occ["L1.mb0.shared_gate_up@shared_expert"].dominator == "experts"


def _family_points(family, tmp_path):
    """The points of a one-layer small ``family``'s shared-mode prefill (expert-parallel on one rank), by name."""
    from launch.engine import make_expert_parallel, prefill, split_for
    from launch.models import build_transformers_model
    from microbatch.batch import Batch

    model = build_transformers_model(family, seed=3, overrides=dict(n_layers=1))
    batch = Batch.random([12, 9], model.cfg.vocab, seed=1)
    make_expert_parallel(model, None)
    with overlap.Timeline() as tl:
        prefill(model, batch, "shared", split_for("shared", batch, None, model=model))
        overlap.synchronize()
    path = tl.save_chrome_trace(str(tmp_path / f"{family}.json"))
    return {o.point: o for o in toolkit_points(named_tasks(path)[1])}


def test_the_indexer_point_on_a_tiny_deepseek_v32(tmp_path):
    indexer = _family_points("deepseek_v32", tmp_path)[f"L0.mb0.indexer@{overlap.INDEXER}"]
    assert indexer.dominator is not None and indexer.overlap_pct is not None


def test_the_longcat_flash_shortcut_point(tmp_path):
    """The shortcut MoE's exchange beside the layer's second attention and the dense MLPs (no data path between)."""
    occ = _family_points("longcat_flash", tmp_path)
    assert occ[f"L0.mb0.dispatch@{overlap.EP_COMM}"].dominator in ("dense0", "attn1", "dense1")


def _kernel(name, stream, ts, dur, pid=0):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": pid, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream}}


def test_named_points_on_a_torch_profiler_trace_per_layer_with_median_and_worst(tmp_path):
    """Three layers: the shared experts on stream 14 beside the grouped matmul on stream 7; the third layer serial."""
    events = []
    for layer, (side_at, dom_at) in enumerate([(100, 100), (400, 380), (800, 700)]):
        events += [_kernel("shared_gate_up_gemm", 14, side_at, 20), _kernel("silu_kernel", 14, side_at + 20, 5),
                   _kernel("shared_down_gemm", 14, side_at + 25, 15),
                   _kernel("attn_kernel", 7, dom_at - 60, 50), _kernel("grouped_mm_kernel", 7, dom_at, 80)]
    path = tmp_path / "torch_prof.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = _run(path, "--points", "--point", "shared", "shared_|silu", "grouped_mm", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    pcts = [p["overlap_pct"] for p in out["points"]]
    assert pcts == pytest.approx([1.0, 1.0, 0.0])  # layer 3: the side stream ran [800, 840], the matmul [700, 780]
    assert [p["verdict"] for p in out["points"]] == [REAL, REAL, FALSE]
    assert out["per_point"]["shared"] == {"occurrences": 3, "median": 1.0, "worst": 0.0}
    text = _run(path, "--points", "--point", "shared", "shared_|silu", "grouped_mm").output
    assert "point shared: 3 occurrences, overlap_pct median 1.00, worst 0.00" in text


KERNEL_HEADER = "Step Id,Device_id,Name,Type,Accelerator Core,Stream ID,Start Time(us),Duration(us),Block Dim\n"


def _kernel_details(tmp_path):
    """One layer, false parallelism: the side stream's two kernels, then a cast on the main stream that waited for
    them (the barrier) ahead of the dominator (20 blocks) while another side kernel (16 blocks) runs beside it,
    and a 60 us EVENT_WAIT at the join."""
    rows = ["1,0,Cast,Cast,AI_VECTOR_CORE,2,1000,5,8",
            "1,0,SharedGateUp,MatMulV2,AI_CORE,5,1000,30,16",
            "1,0,Swish,Swish,AI_VECTOR_CORE,5,1030,10,12",
            "1,0,SiluCast,Cast,AI_VECTOR_CORE,2,1040,4,8",  # started when the side window ended: the barrier
            "1,0,GroupedMatmul,GroupedMatmul,AI_CORE,2,1044,100,20",
            "1,0,EVENT_WAIT,EVENT_WAIT,,2,1144,60,0",
            "1,0,OtherMatMul,MatMulV2,AI_CORE,5,1100,100,16"]  # beside the dominator: 36 blocks at once
    folder = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    folder.mkdir(parents=True)
    (folder / "kernel_details.csv").write_text(KERNEL_HEADER + "\n".join(rows) + "\n")
    return tmp_path


def test_kernel_details_block_dim_over_subscription_and_the_join_wait_are_named(tmp_path):
    root = _kernel_details(tmp_path)
    r = _run(root, "--points", "--point", "shared", "Shared|Swish", "GroupedMatmul", "--cores", 24,
             "--wait-gap-us", 50, "--json")
    assert r.exit_code == 0, r.output
    (p,) = json.loads(r.output)["points"]
    assert p["verdict"] == FALSE and p["barrier"] == "SiluCast"
    assert p["block_dim_peak"] == 36 and p["over_subscribed"]
    assert p["join_waits"] == ["EVENT_WAIT 60.00 us on Stream 2 at 144.00 us"]
    text = _run(root, "--points", "--point", "shared", "Shared|Swish", "GroupedMatmul", "--cores", 48).output
    assert "Block Dim peak 36/48" in text and "OVER-SUBSCRIBED" not in text
    assert "after the join: EVENT_WAIT 60.00 us" in text  # over the default gap
    ini = tmp_path / "Ascend910B4.ini"
    ini.write_text("[SoCInfo]\nai_core_cnt=24\ncube_core_cnt=24\n")
    text = _run(root, "--points", "--point", "shared", "Shared|Swish", "GroupedMatmul", "--cores", ini).output
    assert "Block Dim peak 36/24 OVER-SUBSCRIBED (GroupedMatmul 20 on Stream 2; OtherMatMul 16 on Stream 5)" in text


def test_points_file_and_the_gate_on_named_points(tmp_path):
    root = _kernel_details(tmp_path)
    points = tmp_path / "points.txt"
    points.write_text("# name side dominator\nshared Shared|Swish GroupedMatmul\nmissing NoSuchKernel GroupedMatmul\n")
    r = _run(root, "--points", "--points-file", points, "--min-point-overlap", 0.9)
    assert r.exit_code == EXIT_BELOW
    assert "FAIL: point missing: no occurrence (no operation matches 'NoSuchKernel')" in r.output
    assert "FAIL: point shared: overlap_pct 0.00 < 0.9" in r.output


@pytest.mark.parametrize("args, message", [
    (["--points", "--point", "p", "(", "x"], "--point p: SIDE_REGEX '(' is not a regular expression"),
    (["--points", "--cores", "many"], "--cores many: neither a core count nor a readable platform ini"),
    (["--points", "--cores", "0"], "--cores 0: not a positive core count"),
    (["--cores", "24"], "--cores: only used with --points, which is not given"),
    (["--point", "a", "b", "c"], "--point: only used with --points"),
    (["--points", "--min-overlap", "0.5"], "--points reports per point; --min-overlap"),
    (["--points", "--point", "a", "x", "y", "--point", "a", "x", "y"], "--point a: named twice"),
])
def test_bad_point_options_are_one_line_and_exit_2(tmp_path, args, message):
    r = _run(_false_point(tmp_path), *args)
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_profiler_trace_without_named_points_and_a_bad_points_file_are_refused(tmp_path):
    root = _kernel_details(tmp_path)
    r = _run(root, "--points")
    assert r.exit_code == EXIT_BAD_INPUT and "does not name its parallel points" in r.output
    bad = tmp_path / "bad.txt"
    bad.write_text("shared Shared\n")
    r = _run(root, "--points", "--points-file", bad)
    assert r.exit_code == EXIT_BAD_INPUT and "line 1 has 2 field(s)" in r.output
    r = _run(root, "--points", "--points-file", tmp_path / "none.txt")
    assert r.exit_code == EXIT_BAD_INPUT and "cannot read it" in r.output


def test_without_points_the_report_is_unchanged(tmp_path):
    r = _run(SHIPPED)
    assert r.exit_code == 0 and "parallel points" not in r.output and "pair  default | shared_expert" in r.output


def test_a_named_point_in_a_torch_npu_trace_view():
    """The exchange's tasks on stream 5 in [50, 150] us beside MatMulV2 in [0, 100] us (of the shipped profile)."""
    r = _run(os.path.join(DATA, "npu_prof", "rank0_ascend_pt"), "--points", "--point", "a2a",
             "hcom|Memcpy|Reduce_Inline|Notify", "MatMulV2", "--json")
    assert r.exit_code == 0, r.output
    (p,) = json.loads(r.output)["points"]
    assert (p["dominator"], p["verdict"]) == ("MatMulV2", REAL) and p["overlap_pct"] == pytest.approx(0.5)


def test_the_worked_example_in_the_docs_is_what_the_report_prints(monkeypatch):
    root = os.path.dirname(os.path.dirname(DATA))
    with open(os.path.join(root, "docs", "observability.md")) as f:
        doc = f.read()
    command = "$ overlap-report tests/data/shared_tiny_timeline.json --points --min-point-overlap 0.5\n"
    shown = doc.split(command, 1)[1].split("```", 1)[0]
    monkeypatch.chdir(root)
    r = _run("tests/data/shared_tiny_timeline.json", "--points", "--min-point-overlap", 0.5)
    assert r.exit_code == EXIT_BELOW and r.output == shown


def test_a_point_seen_on_several_ranks_with_no_dominator_is_summed_up_in_words():
    """A 2-rank trace (the launcher's --out): each rank's exchange point once, neither with a main-stream operation
    beside it: the summary line says so (before: a TypeError formatting None, a traceback)."""
    from overlap.observability._points import Occurrence
    from overlap.observability.report import render_points

    occurrences = [Occurrence("L1.mb0.combine@ep_comm", f"rank {r}", (0.001, 0.002)) for r in range(2)]
    occurrences += [Occurrence("L1.mb0.shared_act@shared_expert", f"rank {r}", (0.001, 0.002), "experts",
                               (0.0015, 0.003)) for r in range(2)]
    text = render_points("trace.json", occurrences, None)
    assert "point L1.mb0.combine@ep_comm: 2 occurrences, no dominator in any" in text
    assert "point L1.mb0.shared_act@shared_expert: 2 occurrences, overlap_pct median 0.50, worst 0.50" in text
