"""`launch/prefill.py` driven as users run it: one process, torchrun on 2 ranks, errors, a dead rank."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from support.launcher import ROOT, SCRIPT, TINY, run_here, run_launcher

pytestmark = pytest.mark.spawns_ranks  # drives torchrun itself


def _trace_lanes(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    return {e["pid"] for e in spans}, {names.get((e["pid"], e["tid"])) for e in spans}


def test_single_process_all_modes_check_and_outputs(tmp_path):
    proc = run_launcher(TINY + ["--seq-lens", "16,9,7", "--check", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: every mode matches serial" in proc.stdout
    assert "prefill: 3 layers (1 dense, 2 MoE)," in proc.stdout  # the tiny preset's first layer is dense
    for mode in ("serial", "shared", "two-batch"):
        assert mode in proc.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["world_size"] == 1 and res["check"] == "passed" and res["serial_added"] is False
    assert [r["mode"] for r in res["rows"]] == ["serial", "shared", "two-batch"]
    assert all(r["max_diff"] <= 1e-4 and len(r["times_s"]) == 1 for r in res["rows"])
    # one rank: no communication, so no difference from serial is a speedup; the figures stay in results.json
    assert [r["speedup_label"] for r in res["rows"]] == ["reference", "noise", "noise"]
    assert all(r["speedup"] > 0 and r["serial_schedule"] is None for r in res["rows"])
    assert "~: one rank: no communication to overlap, so no difference from serial is a speedup" in proc.stdout
    ranks, lanes = _trace_lanes(tmp_path / "trace_two-batch.json")
    assert len(ranks) == 1 and {"default", "ep_comm"} <= lanes
    assert (tmp_path / "timeline_two-batch.png").stat().st_size > 1000


def _launch_names(trace):
    return {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}


def test_the_dispatch_in_one_step_is_one_option_away_and_equal(tmp_path):
    """--dispatch one-step: the MoE layers' count exchange read where it is issued (no dispatch_counts launch),
    every mode equal to serial; the ranks agree on it like on every option that shapes the run."""
    from launch.agreement import fingerprint

    assert (fingerprint(_job())["--dispatch"], fingerprint(_job(dispatch="one-step"))["--dispatch"]) == \
        ("two-step", "one-step")
    proc = run_launcher(TINY + ["--seq-lens", "16,12", "--mode", "two-batch", "--check", "--dispatch", "one-step",
                                "--out", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["dispatch"] == "one-step" and res["check"] == "passed"
    names = _launch_names(tmp_path / "trace_two-batch.json")
    assert "dispatch" in names and "dispatch_counts" not in names


def test_two_ranks_under_torchrun_with_kv_offload(tmp_path):
    proc = run_launcher(TINY + ["--seq-lens", "24,20,9", "--check", "--kv-offload", "--kv-store", "mmap",
                                "--out", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("check: every mode matches serial") == 1  # rank 0 alone prints
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["world_size"] == 2 and res["kv_offload"] and res["check"] == "passed" and res["dispatch"] == "two-step"
    ranks, lanes = _trace_lanes(tmp_path / "trace_two-batch.json")
    assert len(ranks) == 2 and {"default", "ep_comm", "kv_offload"} <= lanes
    assert {"dispatch_counts", "dispatch"} <= _launch_names(tmp_path / "trace_two-batch.json")  # two steps
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["kv-rank0.kv", "kv-rank1.kv"]
    two = next(r for r in res["rows"] if r["mode"] == "two-batch")
    assert two["hidden_comm_share"] is not None and 0.0 <= two["hidden_comm_share"] <= 1.0


HERE = "here"  # ranks: `launch.prefill.main` in this process (as tests/test_generate_cli.py's bad options): the
# check runs before any rank joins a group, and a process of its own cost ~4 s a case; one single-process case
# (top-k 9) and the torchrun ones still run as users run them, through the script's exit


@pytest.mark.parametrize("args, ranks, message", [
    (["--experts", "5"], 2, "--experts 5 cannot be split evenly over 2 ranks: give a multiple of 2"),
    (["--experts", "8", "--top-k", "9"], None, "top_k=9 must be between 1 and n_experts=8"),
    (["--device", "cuda"], HERE, "no CUDA device"),
    (["--seq-lens", "4,0"], HERE, "at least one token"),
    (["--seq-lens", "4,x"], HERE, "comma-separated integers"),
    (["--cpu-link", "fast"], HERE, "--cpu-link: expected"),
    (["--path", "aclgraph"], HERE, "--path aclgraph runs on Ascend NPUs only"),
    (["--timeout", "0"], 2, "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], HERE, "--timeout must be a positive number of seconds"),
    (["--seq-lens", ""], HERE, "--seq-lens is empty"),
    (["--seq-lens", "8,,8"], HERE, "--seq-lens has an empty item (two commas, or one at an end): '8,,8'"),
    (["--batch", "0"], HERE, "--batch and --seq-len must be at least 1 (or give --seq-lens), got --batch 0"),
    (["--mode", "serial,bogus"], 2, "unknown mode 'bogus' (valid: serial, shared, two-batch, three-batch, "
                                    "four-batch, all, auto; a comma-separated list)"),
    (["--mode", "serial,"], HERE, "an empty mode name in 'serial,'"),
    (["--cpu-link", "1,nan"], HERE, "--cpu-link"),
    (["--cpu-link", "1,inf"], HERE, "--cpu-link"),
])
def test_invalid_configuration_is_reported_once_and_every_rank_fails(args, ranks, message, capsys, monkeypatch):
    if args[:2] == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    if ranks == HERE:
        from launch.prefill import main

        returncode, out, err = run_here(main, TINY + args, capsys, monkeypatch)
        out += err
    else:
        proc = run_launcher(TINY + args, ranks=ranks, timeout=120)
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    assert returncode != 0
    assert out.count(message) == 1, out[-3000:]
    assert 'prefill.py", line' not in out  # a clear message, no traceback from our code


@pytest.mark.parametrize("kind, expect", [
    ("hang", "rank 1 stopped responding"),
    ("raise", "rank 1 failed: RuntimeError: injected fault"),
])
def test_a_dead_rank_is_named_and_the_others_exit(kind, expect):
    proc = run_launcher(TINY + ["--seq-lens", "40,9", "--iters", "2", "--timeout", "8", "--mode", "serial"], ranks=2,
                        env={"OVERLAP_FAULT": f"rank=1,iter=1,kind={kind}"}, timeout=150)
    assert proc.returncode != 0
    assert expect in proc.stderr, proc.stderr[-3000:]
    # an unexpected exception shows its traceback once (from the rank that hit it); a hung peer does not
    assert proc.stderr.count("in maybe_fail") == (1 if kind == "raise" else 0), proc.stderr[-3000:]


def test_an_unexpected_error_prints_its_traceback_and_fails():
    proc = run_launcher(TINY + ["--mode", "serial"], env={"OVERLAP_FAULT": "rank=0,iter=0,kind=raise"}, timeout=120)
    assert proc.returncode == 1
    assert "rank 0: RuntimeError: injected fault on rank 0 at iteration 0" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and 'prefill.py", line' in proc.stderr
    assert proc.stderr.count("in maybe_fail") == 1, proc.stderr[-3000:]


def test_check_runs_serial_beside_a_mode_list_that_leaves_it_out(tmp_path):
    """`--mode` takes comma-separated lists, given more than once they add up (repeats dropped, order
    kept), and `--check` adds serial as the reference, says so, and shows it in the table and the JSON."""
    proc = run_launcher(TINY + ["--seq-lens", "40,24", "--mode", "three-batch,four-batch", "--mode", "three-batch",
                                "--check", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "modes: serial, three-batch, four-batch (serial added: the reference of --check)" in out, out
    assert "check: every mode matches serial" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"[a-z-]+ +[0-9.]+ \[", line)]
    assert rows == ["serial", "three-batch", "four-batch"], out  # the table: serial first, as the reference
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in res["rows"]] == ["serial", "three-batch", "four-batch"]
    assert res["serial_added"] is True and res["check"] == "passed"


def _job(**options):
    from launch.config import job_config

    common = dict(world=2, device="cpu", exec_path="auto", mode="all", kv_offload=False, kv_store="memory",
                  preset_name="tiny", overrides={}, batch=2, seq_len=16, seq_lens=None, dtype="float32", warmup=0,
                  iters=1, seed=0, check=False, out_dir=None, cpu_link="0.1", timeout=30.0)
    return job_config(**dict(common, **options))


def test_the_mode_list_is_resolved_once_and_is_what_the_ranks_agree_on():
    from launch.agreement import fingerprint
    from launch.config import ConfigError

    assert _job(mode="all").modes == ("serial", "shared", "two-batch")
    assert _job(mode=["serial,shared", "two-batch", "all"]).modes == ("serial", "shared", "two-batch")
    assert _job(mode="three-batch,two-batch,three-batch").modes == ("three-batch", "two-batch")
    assert _job(mode="three-batch").modes == ("three-batch",)
    checked = _job(mode="three-batch", check=True)
    assert checked.modes == ("serial", "three-batch") and checked.serial_added
    assert _job(mode="auto").modes == ("serial", "auto") and _job(mode="two-batch,auto").modes[0] == "serial"
    assert not _job(mode="shared,serial", check=True).serial_added
    # the fingerprint holds the list the ranks will run: spellings of one list agree, other lists do not
    assert fingerprint(_job(mode="all"))["--mode"] == fingerprint(_job(mode="serial,shared,two-batch"))["--mode"]
    assert fingerprint(_job(mode="two-batch", check=True))["--mode"] == ["serial", "two-batch"]
    assert fingerprint(_job(mode="all"))["--mode"] != fingerprint(_job(mode="all,three-batch"))["--mode"]
    with pytest.raises(ConfigError, match="unknown mode 'fast'"):
        _job(mode="serial,fast")


@pytest.mark.parametrize("command, usage", [
    ("from launch.prefill import script; script()", "Usage: overlap-prefill "),  # what the console script runs
    (None, "Usage: launch/prefill.py "),
])
def test_the_help_names_the_command_and_every_kind_of_model(command, usage):
    cmd = [sys.executable, SCRIPT] if command is None else [sys.executable, "-c", command]
    proc = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(usage), proc.stdout[:300]
    summary = " ".join(proc.stdout.split("Options:")[0].split())
    assert "reference decoder" in summary and "transformers" in summary and "checkpoint" in summary, summary


def test_in_bf16_a_few_rows_over_the_tolerance_are_a_near_tie_and_many_a_failure():
    """In bf16 a mode whose output differs from serial's beyond the tolerance in at most 0.1% of the rows passes
    with a note (a router's near-tie rounded the other way in another batch shape: 3 of 8192 rows on an H200);
    more rows, a non-finite difference, or any such row in float32 fail."""
    import torch

    from launch.measure.prefill import ModeResult, _rows_over, check_against_serial, near_tie_notes, tolerance

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8192, 16, generator=g)

    def results(rows, dtype):
        out = ref.clone()
        out[rows, 3] += 0.3  # over 5e-2 x max(1, |ref|) in those rows only
        serial, mode = ModeResult("serial", [0.1], "", [], ref.to(dtype)), ModeResult("two-batch", [0.1], "", [],
                                                                                    out.to(dtype))
        serial.ref_scale, serial.max_diff, serial.rows_over = float(ref.abs().max()), 0.0, 0.0
        # what `launch.measure.prefill._compare` finds (over the ranks: one here)
        mode.max_diff = float((mode.output - serial.output).abs().max())
        mode.rows_over = _rows_over(mode.output, serial.output, tolerance(dtype, serial.ref_scale))
        return [serial, mode]

    few = results([5, 900, 4000], torch.bfloat16)
    assert few[1].rows_over == pytest.approx(3 / 8192)
    assert check_against_serial(few, torch.bfloat16) == []
    (note,) = near_tie_notes(few, torch.bfloat16)
    assert note.startswith("two-batch: 0.037% of the rows differ from serial") and "near-tie" in note
    many = results(list(range(0, 8192, 512)), torch.bfloat16)  # 16 rows: 0.2%
    (msg,) = check_against_serial(many, torch.bfloat16)
    assert msg.startswith("two-batch differs from serial by") and "0.195% of the rows" in msg
    assert near_tie_notes(many, torch.bfloat16) == []
    strict = results([5], torch.float32)
    assert check_against_serial(strict, torch.float32) and near_tie_notes(strict, torch.float32) == []
    broken = results([5], torch.bfloat16)
    broken[1].max_diff = float("inf")
    assert check_against_serial(broken, torch.bfloat16)


def test_check_verdict_fails_a_mode_that_differs_from_serial():
    import torch

    from launch.measure.prefill import ModeResult
    from launch.measure.prefill import check_against_serial as _check

    def result(mode, diff):
        return ModeResult(mode, [0.1], "", [], torch.ones(3) * 10, max_diff=diff, ref_scale=10.0)

    ok = [result("serial", 0.0), result("two-batch", 1e-4)]
    assert _check(ok, torch.float32) == []  # within 1e-4 x max|serial| = 1e-3
    bad = [result("serial", 0.0), result("shared", 0.0), result("two-batch", 2e-3)]
    (msg,) = _check(bad, torch.float32)
    assert msg.startswith("two-batch differs from serial by 2.000e-03")
    assert "needs the serial mode" in _check([result("shared", 0.0)], torch.float32)[0]
    for broken in (float("nan"), float("inf")):  # garbage output must fail the check, not slip through
        assert _check([result("serial", 0.0), result("two-batch", broken)], torch.float32)


@pytest.mark.parametrize("argv,code", [(["--bogus"], 2), (["--preset", "tiny", "--warmup", "0", "--iters", "1"], 0)])
def test_the_script_keeps_the_status_and_runs_the_atexit_handlers(argv, code):
    """`launch.prefill.script` leaves without the interpreter's teardown (gloo's threads can abort it),
    but with the job's status, and after the atexit handlers (the sanitizer's summary is one)."""
    prog = ("import atexit, sys\n"
            "atexit.register(lambda: print('ATEXIT RAN', flush=True))\n"
            f"sys.argv = ['launch/prefill.py'] + {argv!r}\n"
            "from launch.prefill import script\n"
            "script()\n"
            "print('NOT REACHED')\n")
    proc = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "ATEXIT RAN" in proc.stdout and "NOT REACHED" not in proc.stdout


@pytest.mark.parametrize("where", ["atexit", "report"])
def test_sigterm_while_leaving_neither_prints_a_traceback_nor_loses_the_report(where):
    """torchrun sends SIGTERM to every rank once one exits; a rank already leaving with a configuration
    error (all ranks find it) may get it in its atexit handlers or while it prints the report (CI saw a
    `SystemExit: 143` traceback from an atexit handler). It leaves with its own status, report printed."""
    term_self = "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)"
    hook = (f"atexit.register(lambda: ({term_self.split(';')[0]}, time.sleep(0.2)))\n" if where == "atexit" else
            "import launch.job as p\n"
            "first = p.first_to_report_on_this_node\n"
            f"def racing():\n    {term_self}\n    return first()\n"
            "p.first_to_report_on_this_node = racing\n")
    prog = ("import atexit, os, signal, sys, time\n"
            "sys.argv = ['launch/prefill.py', '--timeout', '0']\n"
            + hook +
            "from launch.prefill import script\n"
            "script()\n")
    proc = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("--timeout must be a positive number of seconds") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _signal_in_a_finalizer(sig: str, handler: str, then: str) -> subprocess.CompletedProcess:
    """A program that installs ``launch.job``'s ``handler`` for ``sig``, sends itself ``sig`` from inside a
    ``__del__``, then runs ``then`` (code): the signal lands in the finalizer, as the collector's do."""
    prog = ("import os, signal, sys, time\n"
            "import launch.job as p\n"
            f"signal.signal(signal.{sig}, p.{handler})\n"
            "class Held:\n"
            "    def __del__(self):\n"
            f"        os.kill(os.getpid(), signal.{sig})\n"
            "        for _ in range(1000):\n"
            "            pass\n"
            + then)
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)


def test_sigterm_inside_a_finalizer_ends_the_rank_without_a_traceback():
    """torchrun's SIGTERM can land while the garbage collector runs some library's ``__del__`` (CI saw it in
    regex's): the SystemExit raised there was swallowed, printed as 'Exception ignored in ... Traceback ...
    SystemExit: 143' naming launch/job.py, and the rank ran on. It ends the rank with 143, quietly."""
    proc = _signal_in_a_finalizer("SIGTERM", "_terminated", "Held()\nprint('RAN ON', flush=True)\n")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr[-2000:]
    assert "RAN ON" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_ctrl_c_inside_a_finalizer_still_interrupts_the_run():
    """Ctrl-C can land while the garbage collector runs some ``__del__``: Python swallows the KeyboardInterrupt
    raised there and runs on, so a rank stuck just after (a hang, a wait) stayed stuck and the run's clean-up
    never ran. It is delivered again once out of the finalizer."""
    proc = _signal_in_a_finalizer("SIGINT", "_interrupted", "try:\n    Held()\n    time.sleep(20)\n"
                                  "    print('RAN ON', flush=True)\nexcept KeyboardInterrupt:\n"
                                  "    print('INTERRUPTED', flush=True)\n")
    assert proc.stdout.strip() == "INTERRUPTED", proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("options, env, message", [
    (dict(timeout=1e15), {}, "--timeout must be a positive number of seconds, got 1e+15 (at most 9.22e+09"),
    (dict(seed=99999999999999999999), {}, "--seed must be an integer between 0 and 4294967295, got 9999"),
    (dict(seed=-1), {}, "--seed must be an integer between 0 and 4294967295, got -1"),
    (dict(out_dir=""), {}, "--out is empty"),
    (dict(cpu_link="0"), {}, "--cpu-link: expected 'GBPS[,LATENCY_US]' with a finite GBPS > 0"),
    (dict(model_name="qwen3_moe", overrides=dict(top_k=0)), {},
     "--top-k must be between 1 and 8 (the 8 experts), got 0"),
    (dict(model_name="qwen3_moe", overrides=dict(top_k=9)), {}, "--top-k must be between 1 and 8"),
    (dict(model_name="qwen3_moe", overrides=dict(hidden=30)), {},
     "--hidden must be a multiple of 4 with float32: qwen3_moe's experts run torch's grouped matmul"),
    (dict(model_name="qwen3_moe", overrides=dict(hidden=36), dtype="bfloat16"), {},
     "--hidden must be a multiple of 8 with bfloat16"),
    (dict(model_name="deepseek_v3", overrides=dict(n_experts=6, top_k=4)), {},
     "--top-k must be between 1 and 3 (the experts of the topk_group=1 of n_group=2 groups it routes within), got 4"),
    (dict(model_name="deepseek_v3", overrides=dict(n_experts=4, top_k=3)), {},
     "--top-k must be between 1 and 2 (the experts of the topk_group=1 of n_group=2 groups it routes within), got 3"),
    (dict(model_name="deepseek_v3", overrides=dict(n_layers=2, n_dense_layers=5)), {},
     "--dense-layers must be between 0 and the 2 layers (--layers), got 5"),
    (dict(model_name="qwen3_moe", overrides=dict(n_dense_layers=3)), {}, "--dense-layers must be between 0 and the 2"),
    (dict(), {"OVERLAP_PATH": "bogus"}, "unknown execution path 'bogus' from $OVERLAP_PATH"),
    (dict(), {"OVERLAP_PATH": "cuda"}, "OVERLAP_PATH=cuda but this run's path is cpu: --device and --path choose"),
    (dict(), {"OVERLAP_ENABLE": "maybe"}, "$OVERLAP_ENABLE='maybe': expected 1, true, on, yes"),
    (dict(), {"OVERLAP_CORE_BUDGET": "abc"}, "OVERLAP_CORE_BUDGET: expected 'aic|aiv' such as '24|48', got 'abc'"),
    (dict(), {"OVERLAP_CORE_BUDGET": "-1"}, "OVERLAP_CORE_BUDGET: expected 'aic|aiv' with aic >= 1"),
    (dict(), {"OVERLAP_GRAPH_PATH": "bogus"}, "unknown graph path 'bogus' from $OVERLAP_GRAPH_PATH"),
    (dict(), {"OVERLAP_SANITIZE": "bogus"}, "$OVERLAP_SANITIZE='bogus': expected 0, 1, warn or raise"),
    (dict(cpu_link="off"), {"OVERLAP_CPU_LINK": "abc"}, "OVERLAP_CPU_LINK: expected 'GBPS[,LATENCY_US]'"),
    (dict(), {"OVERLAP_CPU_COMM_PRIORITY": "high"}, "$OVERLAP_CPU_COMM_PRIORITY: expected one of rt, off"),
    (dict(), {"OVERLAP_CPU_KEEP_MEMORY": "maybe"}, "$OVERLAP_CPU_KEEP_MEMORY='maybe': expected 1, true, on, yes"),
    (dict(auto_split_margin=1.0), {}, "--auto-split-margin must be a fraction in [0, 1) (0.1: a split must be"),
    (dict(auto_split_margin=float("nan")), {}, "--auto-split-margin must be a fraction in [0, 1)"),
    (dict(auto_split_margin=-0.1), {}, "--auto-split-margin must be a fraction in [0, 1)"),
    (dict(), {"OMP_NUM_THREADS": "x"}, "$OMP_NUM_THREADS must be a positive number of threads, got 'x'"),
    (dict(), {"OMP_NUM_THREADS": "0"}, "$OMP_NUM_THREADS must be a positive number of threads, got '0'"),
    # experts the ranks cannot share: where the count comes from, and what runs
    (dict(world=3), {}, "the tiny preset's 8 routed experts cannot be split evenly over 3 ranks: run on 1, 2, 4 or 8 "
                        "ranks, or set --experts to a multiple of 3"),
    (dict(world=3, overrides=dict(n_experts=8)), {}, "--experts 8 cannot be split evenly over 3 ranks: give a "
                                                     "multiple of 3"),
    (dict(world=3, model_name="qwen3_moe"), {}, "--model qwen3_moe's 8 routed experts cannot be split evenly over 3 "
                                                "ranks"),
])
def test_a_bad_option_or_environment_value_is_one_configuration_error_naming_it(monkeypatch, options, env, message):
    """Checked with the options, before any rank joins a group (exit 2 from the command line); before,
    each of these was accepted, or failed later with a traceback or an error from inside the model."""
    from launch.config import ConfigError

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        _job(**options)
    assert message in err.value.message and "\n" not in err.value.message, err.value.message


@pytest.mark.parametrize("args, env, message", [
    (["--timeout", "1e15"], {}, "--timeout must be a positive number of seconds"),
    (["--seed", "99999999999999999999"], HERE, "--seed must be an integer between 0 and 4294967295"),
    (["--out", ""], HERE, "--out is empty"),
    (["--cpu-link", "0"], HERE, "--cpu-link: expected"),
    (["--model", "qwen3_moe", "--top-k", "0"], HERE, "--top-k must be between 1 and 8"),
    ([], {"OVERLAP_SANITIZE": "bogus"}, "$OVERLAP_SANITIZE='bogus'"),
    (["--cpu-link", "off"], {"OVERLAP_CPU_LINK": "abc"}, "OVERLAP_CPU_LINK: expected"),
    ([], {"OVERLAP_PATH": "bogus"}, "$OVERLAP_PATH"),
])
def test_the_command_prints_one_line_and_exits_2(args, env, message, capsys, monkeypatch):
    """A bad option, or environment read by a fresh interpreter, is one line and exit 2; the options alone are
    checked in this process (`HERE`: before any rank joins a group), one of them and the environment's through
    the script's own exit."""
    if env == HERE:
        from launch.prefill import main

        returncode, out, err = run_here(main, TINY + ["--mode", "serial"] + args, capsys, monkeypatch)
        out += err
    else:
        proc = run_launcher(TINY + ["--mode", "serial"] + args, env=env, timeout=120)
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    assert returncode == 2, out[-3000:]
    assert out.count(message) == 1 and "Traceback" not in out, out[-3000:]


def test_the_cpu_link_is_the_options_or_its_environment_default_and_off_is_off():
    """``$OVERLAP_CPU_LINK`` is ``--cpu-link``'s default; ``--cpu-link off`` is plain gloo whatever it says
    (before: the environment's link was used under 'off', here one too slow for the wait bound)."""
    proc = run_launcher(TINY + ["--mode", "serial", "--cpu-link", "off", "--timeout", "10"],
                        env={"OVERLAP_CPU_LINK": "1e-9"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "simulated link" not in proc.stdout and "WaitTimeout" not in proc.stderr
    proc = run_launcher(TINY + ["--mode", "serial"], env={"OVERLAP_CPU_LINK": "2,20"}, timeout=120)
    assert proc.returncode == 0 and "| simulated link 2 GB/s, 20 us" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("env, key, values", [
    ({"OVERLAP_ENABLE": "0"}, "$OVERLAP_ENABLE", ("on", "off")),
    ({"OVERLAP_SANITIZE": "raise"}, "$OVERLAP_SANITIZE", ("off", "raise")),
    ({"OVERLAP_CORE_BUDGET": "24|48"}, "$OVERLAP_CORE_BUDGET", (None, "24|48")),
    ({"OVERLAP_SOC_VERSION": "Ascend910B1"}, "$OVERLAP_SOC_VERSION", (None, "Ascend910B1")),
])
def test_the_environment_that_shapes_the_run_is_part_of_what_the_ranks_agree_on(monkeypatch, env, key, values):
    from launch.agreement import fingerprint

    for name in env:  # the suite may run with one of them set (OVERLAP_SANITIZE=1)
        monkeypatch.delenv(name, raising=False)
    plain = fingerprint(_job())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (plain[key], fingerprint(_job())[key]) == values


def test_group_routing_that_does_not_fit_the_experts_is_named_with_its_valid_range():
    """DeepSeek-V3 scores each of n_group groups by its best 2 experts and picks top-k in the best topk_group:
    a config whose groups do not hold that (a checkpoint's, or one edited) is refused before any model runs
    (its router failed with 'selected index k out of range')."""
    import torch
    from transformers import AutoConfig

    from launch.config import ConfigError, check_transformers_model

    cfg = AutoConfig.for_model("deepseek_v3", n_routed_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1)
    check_transformers_model("deepseek_v3", cfg, torch.float32)
    cfg.n_group = 2
    with pytest.raises(ConfigError, match=r"--experts 2: deepseek_v3 routes within n_group=2 groups of experts, "
                                          r"scoring each by its best 2: the experts must be a multiple of 2, at least 4"):
        check_transformers_model("deepseek_v3", cfg, torch.float32)
    cfg.n_group, cfg.topk_group = 1, 2
    with pytest.raises(ConfigError, match="topk_group=2 must be between 1 and n_group=1"):
        check_transformers_model("deepseek_v3", cfg, torch.float32)


def test_device_auto_runs_the_cpu_path_where_overlap_path_says_so_on_a_machine_with_a_gpu(monkeypatch):
    """The suite sets OVERLAP_PATH=cpu (tests/conftest.py): on a GPU machine its launcher runs start CPU ranks,
    not two ranks on its one card. A path whose device is not here still fails, naming $OVERLAP_PATH."""
    import torch

    import overlap
    from launch.config import ConfigError, resolve_device

    monkeypatch.setattr(overlap, "detect_path", lambda: "cuda")  # a machine with a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("OVERLAP_PATH", "cpu")
    assert resolve_device("auto", None) == "cpu"
    monkeypatch.setenv("OVERLAP_PATH", "cuda")
    assert resolve_device("auto", None) == "cuda"
    monkeypatch.delenv("OVERLAP_PATH")
    assert resolve_device("auto", None) == "cuda"
    monkeypatch.setattr(overlap, "detect_path", lambda: "cpu")  # and one without
    monkeypatch.setenv("OVERLAP_PATH", "cuda")
    assert resolve_device("auto", None) == "cpu"  # the job's environment check names OVERLAP_PATH=cuda next
    monkeypatch.setenv("OVERLAP_PATH", "tpu")
    with pytest.raises(ConfigError, match="OVERLAP_PATH"):
        resolve_device("auto", None)


def test_the_auto_split_margin_reaches_the_planner_and_the_ranks_agree_on_it(monkeypatch):
    import microbatch.planning as planning
    from launch import prefill
    from launch.agreement import fingerprint
    from launch.job import CalibrationSource

    job = _job(mode="auto", auto_split_margin=0.2)
    assert job.split_margin == 0.2 and _job(mode="auto").split_margin == planning.SPLIT_MARGIN
    assert fingerprint(job)["--auto-split-margin"] == 0.2 != fingerprint(_job(mode="auto"))["--auto-split-margin"]
    seen = {}
    monkeypatch.setattr(planning, "gather_lens", lambda lens, group: [tuple(lens)])
    monkeypatch.setattr(planning, "calibrate", lambda *a, **k: "calibration")
    monkeypatch.setattr(planning, "request_length", lambda all_lens: 16)

    class _Said:
        def format(self):
            return "auto: chose serial"

    monkeypatch.setattr(planning, "choose", lambda cal, model, all_lens, **kw: seen.update(kw) or _Said())
    batch = type("B", (), {"seq": type("S", (), {"seq_lens": (16, 16)})()})()
    prefill._choose_auto(job, model=None, batch=batch, source=CalibrationSource())
    assert seen["split_margin"] == 0.2


def test_refresh_calibration_reaches_the_calibration_and_the_ranks_agree_on_it(monkeypatch):
    import microbatch.planning as planning
    from launch import prefill
    from launch.agreement import fingerprint
    from launch.job import CalibrationSource

    asked = []
    monkeypatch.setattr(planning, "gather_lens", lambda lens, group: [tuple(lens)])
    monkeypatch.setattr(planning, "calibrate", lambda *a, **k: asked.append(k["refresh"]) or "calibration")
    monkeypatch.setattr(planning, "request_length", lambda all_lens: 16)
    monkeypatch.setattr(planning, "choose", lambda *a, **k: type("C", (), {"format": lambda self: ""})())
    batch = type("B", (), {"seq": type("S", (), {"seq_lens": (16, 16)})()})()
    for refresh in (False, True):
        job = _job(mode="auto", refresh_calibration=refresh)
        prefill._choose_auto(job, model=None, batch=batch, source=CalibrationSource())
        assert fingerprint(job)["--refresh-calibration"] is refresh
    assert asked == [False, True]


def _scaled(path, factor):
    """The prefill calibration in the cache file ``path`` with every operation's cost times ``factor`` (as one
    measured on a host ``factor`` times slower), written back, its file three days old."""
    data = json.loads(open(path).read())
    for kind in ("ops", "layer_ops"):
        for fit in data["calibration"][kind]:
            fit["a"], fit["b"] = fit["a"] * factor, fit["b"] * factor
    with open(path, "w") as f:
        json.dump(data, f)
    os.utime(path, (os.path.getmtime(path) - 3 * 86400 - 600,) * 2)


def test_auto_says_where_its_calibration_came_from_and_notes_a_stale_one():
    """One process, --mode auto three times over one cache (the conftest's, of this test): measured (its file
    said), read from a cache file whose costs are far from this host's (as one measured on a slower host), with
    when it was measured and a note suggesting --refresh-calibration, which measures it again. In a log (stderr is
    no terminal) the progress is a line a stage of the calibration and a line a round, with what the round is
    for, never a line a mode and round."""
    args = TINY + ["--seq-lens", "32,16", "--mode", "auto", "--warmup", "1", "--iters", "2"]
    first = run_launcher(args)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    path = re.search(r"^calibrating the operations and the interconnect \(none cached for this machine and model; "
                     r"cached after this run in (\S+\.json)\)$", first.stdout, re.M).group(1)
    phases = ["warm-up", "timed", "timed", "recorded for the trace"]
    rounds = [line.split(":")[0] for line in first.stderr.splitlines() if line.startswith("round ")]
    assert rounds == [f"round {i + 1}/4 ({phase})" for i, phase in enumerate(phases)], first.stderr
    stages = [line for line in first.stderr.splitlines() if line.startswith("calibrating: ")]
    assert [line.split(",")[0].split(" at ")[0] for line in stages] == \
        ["calibrating: warm-up"] + ["calibrating: the operations"] * 3 + \
        ["calibrating: the link and the host's contention"], first.stderr  # a line a stage of the calibration

    _scaled(path, 20.0)
    stale = run_launcher(args)
    assert stale.returncode == 0, stale.stdout + stale.stderr[-3000:]
    assert re.search(r"^calibration: cached \(" + re.escape(path) + r"\), measured \d{4}-\d\d-\d\d \d\d:\d\d, "
                     r"3 days ago$", stale.stdout, re.M), stale.stdout
    assert re.search(r"^auto: the cached calibration predicted [0-9.]+ ms and this run measured [0-9.]+ ms \(\d+% "
                     r"apart.*--refresh-calibration measures it again$", stale.stdout, re.M), stale.stdout

    refreshed = run_launcher(args + ["--refresh-calibration"])
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr[-3000:]
    assert f"(refreshing; cached after this run in {path})" in refreshed.stdout, refreshed.stdout
    assert "--refresh-calibration measures it again" not in refreshed.stdout, refreshed.stdout


@pytest.mark.parametrize("cores, ranks, threads", [(2, 1, 1), (2, 2, 1), (16, 1, 15), (16, 2, 7), (64, 8, 7),
                                                   (1, 1, 1)])
def test_a_rank_computes_with_the_cores_less_one_shared_by_the_nodes_ranks(cores, ranks, threads, monkeypatch):
    """As torchrun sets $OMP_NUM_THREADS (1 a rank with several on a node), but from the cores: the node's cores
    less one (gloo's, the link's and the copy threads run there), shared by its ranks; the user's value wins."""
    from launch.config import compute_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert compute_threads(ranks, cores) == (threads, f"{cores} cores less one, {ranks} rank(s) on this node")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert compute_threads(ranks, cores) == (5, "$OMP_NUM_THREADS")


@pytest.mark.parametrize("script, omp", [(SCRIPT, None), (SCRIPT, "3"), (os.path.join(ROOT, "launch", "generate.py"),
                                                                          "3")])
def test_the_launchers_set_the_threads_they_compute_with_and_say_so(script, omp):
    """Each launcher sets torch's threads before it computes (the headline reads them back from torch): the cores
    less one without $OMP_NUM_THREADS (a 1-rank generation on a busy 2-core host took 5x as long to its first
    token with torch's default of every core), $OMP_NUM_THREADS where the user set it."""
    from support import zygote

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OVERLAP_FAULT")}
    env["PYTHONPATH"] = ROOT
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    args = TINY + ["--mode", "serial", "--seq-lens", "8"] + (["--new-tokens", "2"] if "generate" in script else [])
    proc = zygote.run([sys.executable, script] + args, env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    said = ("3 compute threads per rank ($OMP_NUM_THREADS)" if omp else
            f"{max(1, cores - 1)} compute thread{'s' if cores > 2 else ''} per rank ({cores} cores less one, 1 rank(s) "
            f"on this node)")
    assert f"1 rank(s) on cpu, {said} | " in proc.stdout.splitlines()[0], proc.stdout
