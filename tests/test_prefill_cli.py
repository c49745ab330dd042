"""`launch/prefill.py` driven as users run it: one process, torchrun on 2 ranks, errors, a dead rank."""
import json
import os
import re
import subprocess
import sys

import pytest
from _ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "prefill.py")
pytestmark = pytest.mark.spawns_ranks  # drives torchrun itself
TINY = ["--preset", "tiny", "--warmup", "0", "--iters", "1"]


def _run(args, ranks=None, env=None, timeout=180):
    cmd = [sys.executable, SCRIPT] if ranks is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-port", str(free_port()), SCRIPT]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    full_env.pop("OVERLAP_FAULT", None)
    full_env.update(env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def _trace_lanes(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    return {e["pid"] for e in spans}, {names.get((e["pid"], e["tid"])) for e in spans}


def test_single_process_all_modes_check_and_outputs(tmp_path):
    proc = _run(TINY + ["--seq-lens", "16,9,7", "--check", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: every mode matches serial" in proc.stdout
    assert "prefill: 3 layers (1 dense, 2 MoE)," in proc.stdout  # the tiny preset's first layer is dense
    for mode in ("serial", "shared", "two-batch"):
        assert mode in proc.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["world_size"] == 1 and res["check"] == "passed" and res["serial_added"] is False
    assert [r["mode"] for r in res["rows"]] == ["serial", "shared", "two-batch"]
    assert all(r["max_diff"] <= 1e-4 and len(r["times_s"]) == 1 for r in res["rows"])
    ranks, lanes = _trace_lanes(tmp_path / "trace_two-batch.json")
    assert len(ranks) == 1 and {"default", "ep_comm"} <= lanes
    assert (tmp_path / "timeline_two-batch.png").stat().st_size > 1000


def test_two_ranks_under_torchrun_with_kv_offload(tmp_path):
    proc = _run(TINY + ["--seq-lens", "24,20,9", "--check", "--kv-offload", "--kv-store", "mmap",
                        "--out", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("check: every mode matches serial") == 1  # rank 0 alone prints
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["world_size"] == 2 and res["kv_offload"] and res["check"] == "passed"
    ranks, lanes = _trace_lanes(tmp_path / "trace_two-batch.json")
    assert len(ranks) == 2 and {"default", "ep_comm", "kv_offload"} <= lanes
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["kv-rank0.kv", "kv-rank1.kv"]
    two = next(r for r in res["rows"] if r["mode"] == "two-batch")
    assert two["hidden_comm_share"] is not None and 0.0 <= two["hidden_comm_share"] <= 1.0


@pytest.mark.parametrize("args, ranks, message", [
    (["--experts", "5"], 2, "5 experts cannot be split evenly over 2 ranks"),
    (["--experts", "8", "--top-k", "9"], None, "top_k=9 must be between 1 and n_experts=8"),
    (["--device", "cuda"], None, "no CUDA device"),
    (["--seq-lens", "4,0"], None, "at least one token"),
    (["--seq-lens", "4,x"], None, "comma-separated integers"),
    (["--cpu-link", "fast"], None, "--cpu-link: expected"),
    (["--path", "aclgraph"], None, "--path aclgraph runs on Ascend NPUs only"),
    (["--timeout", "0"], 2, "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], None, "--timeout must be a positive number of seconds"),
    (["--seq-lens", ""], None, "--seq-lens is empty"),
    (["--mode", "serial,bogus"], 2, "unknown mode 'bogus' (valid: serial, shared, two-batch, three-batch, "
                                    "four-batch, all, auto; a comma-separated list)"),
    (["--mode", "serial,"], None, "an empty mode name in 'serial,'"),
    (["--cpu-link", "1,nan"], None, "--cpu-link"),
    (["--cpu-link", "1,inf"], None, "--cpu-link"),
])
def test_invalid_configuration_is_reported_once_and_every_rank_fails(args, ranks, message):
    if args[:2] == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    proc = _run(TINY + args, ranks=ranks, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(message) == 1, out[-3000:]
    assert 'prefill.py", line' not in out  # a clear message, no traceback from our code


@pytest.mark.parametrize("kind, expect", [
    ("hang", "rank 1 stopped responding"),
    ("raise", "rank 1 failed: RuntimeError: injected fault"),
])
def test_a_dead_rank_is_named_and_the_others_exit(kind, expect):
    proc = _run(TINY + ["--seq-lens", "40,9", "--iters", "2", "--timeout", "8", "--mode", "serial"], ranks=2,
                env={"OVERLAP_FAULT": f"rank=1,iter=1,kind={kind}"}, timeout=150)
    assert proc.returncode != 0
    assert expect in proc.stderr, proc.stderr[-3000:]
    # an unexpected exception shows its traceback once (from the rank that hit it); a hung peer does not
    assert proc.stderr.count("in maybe_fail") == (1 if kind == "raise" else 0), proc.stderr[-3000:]


def test_an_unexpected_error_prints_its_traceback_and_fails():
    proc = _run(TINY + ["--mode", "serial"], env={"OVERLAP_FAULT": "rank=0,iter=0,kind=raise"}, timeout=120)
    assert proc.returncode == 1
    assert "rank 0: RuntimeError: injected fault on rank 0 at iteration 0" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and 'prefill.py", line' in proc.stderr
    assert proc.stderr.count("in maybe_fail") == 1, proc.stderr[-3000:]


def test_check_runs_serial_beside_a_mode_list_that_leaves_it_out(tmp_path):
    """`--mode` takes comma-separated lists, given more than once they add up (repeats dropped, order
    kept), and `--check` adds serial as the reference, says so, and shows it in the table and the JSON."""
    proc = _run(TINY + ["--seq-lens", "40,24", "--mode", "three-batch,four-batch", "--mode", "three-batch", "--check",
                        "--out", str(tmp_path)])
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


def test_check_verdict_fails_a_mode_that_differs_from_serial():
    import torch

    from launch.measure import ModeResult
    from launch.measure import check_against_serial as _check

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
            "import launch.prefill as p\n"
            "first = p._first_to_report_on_this_node\n"
            f"def racing():\n    {term_self}\n    return first()\n"
            "p._first_to_report_on_this_node = racing\n")
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
