"""The generation launcher, ``launch/generate.py``, as its users run it."""
import json
import os
import re
import sys

import pytest
import torch

from support import zygote
from support.launcher import GENERATE, ROOT, TINY, run_here, run_launcher

pytestmark = [pytest.mark.spawns_ranks, pytest.mark.timeout(300)]  # drives torchrun itself


def _run(args, ranks=None, env=None, timeout=180):
    return run_launcher(TINY + list(args), ranks=ranks, env=env, timeout=timeout, script=GENERATE)


@pytest.mark.parametrize("args, words", [
    (["--new-tokens", "0"], "--new-tokens must be at least 1, got 0"),
    (["--new-tokens-spread", "1"], "--new-tokens-spread must be in [0, 1), got 1"),
    (["--stop-token", "100000"], "--stop-token must be a token id in [0, "),
    (["--mode", "auto"], "--mode auto is not available in generation"),
    (["--mode", "serial,shared,two-batch", "--decode-mode", "serial,shared"],
     "--decode-mode lists 2 modes and --mode 3"),
    (["--decode-mode", "five-batch"], "unknown mode 'five-batch'"),
    (["--decode-graph", "cpu", "--kv-offload"], "--decode-graph captures steps over the device cache"),
    (["--decode-buckets", "0,4"], "--decode-buckets must be positive sizes"),
    (["--decode-graph", "off", "--decode-length-buckets"], "--decode-length-buckets sizes the captured steps' "
                                                            "attention; with --decode-graph off"),
    (["--decode-calibration-rounds", "0"], "--decode-calibration-rounds must be at least 1, got 0"),
    (["--new-tokens", "99999999999999999999"], "--new-tokens must be at most 2147483647 (each request's KV cache"),
    (["--decode-buckets", "1000000000000000000000"], "--decode-buckets sizes must be at most 2147483647"),
    (["--decode-length-buckets"], "--decode-graph auto captures none here (cpu, the steps run eager)"),
    (["--batch", "0"], "--batch and --seq-len must be at least 1 (or give --seq-lens), got --batch 0"),
    (["--out", "/dev/null"], "--out /dev/null is not a directory"),
    (["--decode-auto-modes", "serial,auto"], "--decode-auto-modes names decode modes for auto to choose from"),
    (["--decode-auto-modes", "all"], "--decode-auto-modes names decode modes for auto to choose from"),
    (["--decode-auto-modes", "two-batch,five-batch"], "unknown mode 'five-batch'"),
    (["--decode-exchange", "mc2"], "--decode-exchange mc2 runs torch_npu's fused MC2 operators on Ascend (--device "
                                   "npu), not on cpu"),
    (["--decode-exchange", "nccl"], "Invalid value for '--decode-exchange'"),
    (["--path", "ge"], "--path ge compiles a prefill job's modes as one graph each; generation prefills its KV cache "
                       "on the eager path: leave --path out (or --path npu) and capture the decode steps with "
                       "--decode-graph ge"),
    (["--path", "aclgraph"], "capture the decode steps with --decode-graph aclgraph"),
    (["--kv-offload", "--kv-store", "mmap"], "--kv-store mmap keeps a prefill job's offloaded keys and values in "
                                             "files; generation's host cache (--kv-offload) is in host memory"),
    (["--kv-store", "mmap"], "(and without --kv-offload the cache stays on the device)"),
    (["--auto-split-margin", "0.2"], "--auto-split-margin sets what a split must gain under prefill's --mode auto, "
                                     "which generation does not run"),
])
def test_a_bad_generation_option_is_one_line_before_any_rank_joins(args, words, capsys, monkeypatch):
    from launch.generate import main

    code, _, err = run_here(main, TINY + list(args), capsys, monkeypatch)  # the check runs before any group is joined
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert code == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in err, err


@pytest.mark.parametrize("fault, words", [
    ("garbage", "$OVERLAP_FAULT: 'garbage' is not rank=N, iter=N or kind=K"),
    ("rank=1,iter=x", "$OVERLAP_FAULT: iter=x is not an integer"),
    ("rank=1,kind=bogus", "$OVERLAP_FAULT: kind=bogus is not a fault (one of exit|hang|raise|nan|inf|scale)"),
])
def test_a_bad_fault_injection_is_one_line_naming_the_variable_before_any_rank_joins(fault, words, capsys,
                                                                                     monkeypatch):
    """(Before: the parser's ValueError and a traceback after the headline; kind=bogus accepted.)"""
    from launch.generate import main

    monkeypatch.setenv("OVERLAP_FAULT", fault)
    code, _, err = run_here(main, TINY, capsys, monkeypatch)
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert code == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in err, err


def test_a_kv_cache_too_big_for_the_memory_is_refused_with_the_numbers():
    """--new-tokens 1000000000: the KV cache of the new tokens is in the memory check, before the model is built
    (before: the allocation failed after it, with a traceback)."""
    proc = _run(["--new-tokens", "1000000000"], ranks=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and 1 <= out.count("needs about") <= 2 and "KV cache" in out, out[-3000:]
    assert "KV cache 11444" in out and "generate:" not in out, out[-3000:]  # before the headline: nothing built


def test_the_kv_cache_estimate_holds_the_new_tokens_the_padded_room_and_every_kept_cache():
    from launch.config import job_config
    from launch.memory import decode_kv_cache

    job = job_config(world=1, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                     preset_name="tiny", overrides={}, batch=3, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                     iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=10)
    eager = decode_kv_cache(job, 1000)
    assert eager == decode_kv_cache(job, 0) * 1008 // 8  # 3 slots of 8 prompt rows + 1000 new tokens each
    assert decode_kv_cache(job, 1000, caches=2) == 2 * eager
    assert decode_kv_cache(job, 1000, padded=True) == eager + eager // 3 * 8  # 3 slots padded to 2 x 4 rows


@pytest.mark.parametrize("graph, words", [
    ("cuda", "--decode-graph cuda: needs a CUDA device, and this machine has none"),
    ("ge", "--decode-graph ge: needs an Ascend NPU, and this machine has none"),
    ("aclgraph", "--decode-graph aclgraph: needs an Ascend NPU, and this machine has none"),
])
def test_a_decode_graph_this_machine_cannot_capture_on_is_one_line_before_any_rank_joins(graph, words, capsys,
                                                                                        monkeypatch):
    """As --path ge and --decode-exchange mc2 are (before: accepted, the headline printed, then every rank failed
    with torch.cuda.Stream's RuntimeError, No module named 'torch_npu' or Invalid backend 'npugraph_ex')."""
    from launch.engine import capture_problem
    from launch.generate import main

    if capture_problem(graph) is None:
        pytest.skip(f"this machine captures on {graph}")
    code, out, err = run_here(main, TINY + ["--decode-graph", graph], capsys, monkeypatch)
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert code == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in err, err
    assert "captured per bucket" not in out + err  # no headline: nothing started


def test_two_ranks_that_finish_apart_generate_every_modes_tokens_on_the_device_and_the_host_cache(tmp_path):
    """Spread lengths (the ranks' requests end at different steps), a stop token, --check and --out: every mode
    generates serial's tokens, the table shows each mode's figures and the files are written. With
    --kv-offload (the cache on the host, prefetched) every mode generates the same tokens, and the table and
    results say how much of the prefetch compute hid."""
    args = ["--mode", "all", "--new-tokens", "8", "--new-tokens-spread", "0.75", "--stop-token", "5", "--batch", "3",
            "--seq-len", "16", "--decode-calibration-rounds", "1", "--decode-mode", "serial,auto,two-batch", "--check"]
    device = _run(args + ["--out", str(tmp_path / "device")], ranks=2)
    assert device.returncode == 0, device.stdout + device.stderr[-3000:]
    assert "check: every mode generates serial's tokens" in device.stdout
    for mode in ("serial", "shared / auto", "two-batch"):  # --mode all's prefill modes, paired in order
        assert any(line.startswith(mode + " ") for line in device.stdout.splitlines()), device.stdout
    # auto: the calibration it chose from, then its steps per mode and predicted / measured TPOT beside serial's
    assert "decode calibration, ms at histories 16 / 23" in device.stdout, device.stdout
    assert re.search(r"^noise \(relative standard error of an entry's median\): [0-9.]+% to [0-9.]+%$", device.stdout,
                     re.M) and "faster, and by 1.5 standard errors of the two entries)" in device.stdout, device.stdout
    assert "calibrating decode (none cached for this machine, model and link; cached after this run in " \
        in device.stdout, device.stdout  # the conftest's empty cache of this test
    cached = re.search(r"cached after this run in (\S+)\)", device.stdout).group(1)
    assert json.loads(open(cached).read())["key"]["repeats"] == 1  # --decode-calibration-rounds reached it
    assert re.search(r"^shared / auto: decode steps per mode \d+ [a-z0-9-]+.*; TPOT predicted [0-9.]+ ms, "
                     r"measured [0-9.]+ ms, serial measured [0-9.]+ ms; guard: \d+ serial probe step\(s\) of \d+; "
                     r"(no mode set aside|set aside .+ \(measured slower than serial\))$", device.stdout, re.M), \
        device.stdout
    head = next(line for line in device.stdout.splitlines() if line.startswith("mode "))
    assert head.split()[7:10] == ["p90", "spread", "tokens/s"], head  # TPOT's spread over the rounds
    assert "tokens/s: every rank's generated tokens (each request's first, the prefill's, included) over the " \
           "generation's time" in device.stdout
    results = json.loads((tmp_path / "device" / "results.json").read_text())
    assert results["check"] == "passed" and results["new_tokens_spread"] == 0.75 and results["stop_token"] == 5
    assert results["decode_exchange"] == "capacity"
    rows = {r["mode"]: r for r in results["rows"]}
    assert set(rows) == {"serial", "shared / auto", "two-batch"}
    auto = rows["shared / auto"]
    assert sum(auto["steps_by_mode"].values()) >= auto["decode_steps"] > 0
    assert auto["predicted_tpot_median_s"] > 0 and rows["serial"]["steps_by_mode"] is None
    assert auto["decode_guard"].startswith("guard: ") and rows["serial"]["decode_guard"] is None
    assert rows["serial"]["speedup_label"] == "reference"
    for r in rows.values():
        assert r["tpot_median_s"] > 0 and r["tpot_p90_s"] >= r["tpot_median_s"] and r["ttft_median_s"] > 0
        assert len(r["tpot_rounds_s"]) == 1 and r["tpot_spread"] is None and r["step_spread"] >= 0  # one round
        assert r["speedup_label"] in ("reference", "same schedule", "one round"), r
    if set(auto["steps_by_mode"]) == {"serial"}:  # auto that ran serial's schedule every step says so
        assert auto["speedup_label"] == "same schedule" and auto["serial_schedule"] == "every decode step ran serial"
        assert 0 < r["output_tokens"] <= 2 * 3 * 8 and r["decode_steps"] >= 1 and r["kv_prefetch"] is None
    assert rows["two-batch"]["hidden_comm_share"] is not None
    trace = json.loads((tmp_path / "device" / "trace_two-batch.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"dispatch", "combine"} <= names, names  # one decode step's launches, every rank's

    host = _run(args[2:-3] + ["--decode-mode", "serial,two-batch", "--mode", "serial,two-batch", "--check",
                              "--kv-offload", "--out", str(tmp_path / "host")], ranks=2)
    assert host.returncode == 0, host.stdout + host.stderr[-8000:]  # a rank's error comes before torchrun's summary
    assert "KV prefetch hidden" in host.stdout and "kv cache host, prefetched" in host.stdout, host.stdout
    hosted = {r["mode"]: r for r in json.loads((tmp_path / "host" / "results.json").read_text())["rows"]}
    for mode, r in hosted.items():
        assert r["tokens_sha1"] == rows[mode]["tokens_sha1"], mode
        prefetch = r["kv_prefetch"]
        assert prefetch["copies"] > 0 and prefetch["bytes"] > 0 and 0 <= prefetch["hidden_share"] <= 1, prefetch


def test_decode_steps_captured_per_bucket_generate_serials_tokens():
    """--decode-graph cpu (the padded static step, what the graphs compute) with user buckets, one process."""
    proc = _run(["--batch", "3", "--seq-len", "8", "--new-tokens", "5", "--new-tokens-spread", "0.5", "--mode",
                 "serial", "--decode-mode", "serial,two-batch", "--decode-graph", "cpu", "--decode-buckets", "2,4",
                 "--warmup", "1", "--iters", "1", "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "decode steps captured per bucket on cpu | buckets 2,4" in proc.stdout, proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout, proc.stdout


def test_decode_steps_with_length_buckets_generate_serials_tokens():
    """--decode-length-buckets: each captured step attends over the room its histories use, one process."""
    proc = _run(["--batch", "3", "--seq-len", "8", "--new-tokens", "12", "--mode", "serial", "--decode-mode",
                 "serial,two-batch", "--decode-graph", "cpu", "--decode-length-buckets", "--warmup", "0", "--iters",
                 "1", "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "decode steps captured per bucket and length on cpu" in proc.stdout, proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout, proc.stdout


def test_the_ranks_agree_on_length_buckets():
    from launch.config import decode_config, job_config

    job = job_config(world=1, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                     preset_name="tiny", overrides={}, batch=2, seq_len=16, seq_lens=None, dtype="float32", warmup=0,
                     iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=30.0)
    prints = [decode_config(job, new_tokens=4, spread=0.0, stop_token=None, decode_modes=[], graph="cpu",
                            length_buckets=on).fingerprint() for on in (False, True)]
    assert [p["--decode-length-buckets"] for p in prints] == [False, True]


def test_decode_exchange_auto_runs_the_capacity_exchange_where_mc2_does_not_run():
    """--decode-exchange auto on CPU, one process: MC2 layers whose decode steps take the capacity exchange (no
    torch_npu here), every mode with serial's tokens; the headline names the exchange."""
    proc = _run(["--batch", "2", "--seq-len", "8", "--new-tokens", "3", "--mode", "serial", "--decode-mode",
                 "serial,chunked-2", "--decode-exchange", "auto", "--warmup", "0", "--iters", "1", "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert " | decode exchange auto" in proc.stdout, proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout, proc.stdout


def test_mc2_decode_wants_half_precision_tokens():
    import types

    from launch.config import ConfigError, check_exchange

    npu = types.SimpleNamespace(device="npu", dtype=torch.float32, dispatch_dtype=None)
    with pytest.raises(ConfigError, match="--decode-exchange mc2 takes bfloat16 or float16 tokens, not float32"):
        check_exchange(npu, "mc2")
    check_exchange(types.SimpleNamespace(device="npu", dtype=torch.bfloat16, dispatch_dtype="int8"), "mc2")
    check_exchange(npu, "auto")  # auto runs the capacity exchange wherever MC2 does not
    fp8 = types.SimpleNamespace(device="npu", dtype=torch.bfloat16, dispatch_dtype="fp8")  # MC2 has int8's mode only
    with pytest.raises(ConfigError, match="--decode-exchange mc2 quantizes tokens to int8 only .*not fp8"):
        check_exchange(fp8, "mc2")


def test_auto_chooses_among_captured_steps_from_a_calibration_of_them():
    """--decode-mode auto with --decode-graph cpu, one process: the calibration times the captured steps (padded to
    their buckets, at the points where the buckets end) of the candidates --decode-auto-modes names (serial added),
    and auto's tokens are serial's."""
    proc = _run(["--batch", "3", "--seq-len", "8", "--new-tokens", "4", "--mode", "serial", "--decode-mode", "auto",
                 "--decode-graph", "cpu", "--decode-auto-modes", "chunked-2,two-batch", "--decode-calibration-rounds",
                 "1", "--warmup", "0", "--iters", "1", "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "captured decode steps (padded to their buckets), ms at histories 8 / 11" in proc.stdout, proc.stdout
    head = re.search(r"^tokens +(.*)$", proc.stdout, re.M).group(1).split()
    assert head == ["serial", "chunked-2", "two-batch"], proc.stdout
    assert re.search(r"^serial / auto: decode steps per mode \d+ ", proc.stdout, re.M), proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout, proc.stdout


def test_a_mode_whose_tokens_differ_from_serial_fails_the_check_naming_where():
    """One process; the two-batch run's tokens are changed at step 2 of request 1: --check says where, exit 1."""
    prog = (
        "import sys\n"
        "import launch.measure.generate as g\n"
        "real = g.generate\n"
        "def wrong(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    if k['mode'] == 'two-batch':\n"
        "        out.tokens[1][2] += 1\n"
        "    return out\n"
        "g.generate = wrong\n"
        f"sys.argv = ['launch/generate.py'] + {TINY + ['--batch', '2', '--seq-len', '8', '--new-tokens', '4', '--mode', 'serial,two-batch', '--check']!r}\n"
        "from launch.generate import script\n"
        "script()\n")
    proc = zygote.run([sys.executable, "-c", prog], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert ("two-batch: 1 rank(s) differ from serial's tokens, first at decode step 2 (0: the prefill's token) of "
            "request 1 on rank 0") in proc.stdout, proc.stdout


def test_nan_in_the_logits_fails_the_run_without_check_in_one_line():
    """(Every rank stopping, naming the rank: tests/test_decode.py, on two ranks.)"""
    proc = _run(["--new-tokens", "3", "--mode", "serial"], env={"OVERLAP_FAULT": "rank=0,kind=nan"})
    assert proc.returncode == 1
    text = proc.stdout + proc.stderr
    assert "rank 0: NonFiniteLogits: NaN or inf in the logits of request 0 at decode step 0" in text, text[-3000:]
    assert "unexpected error" not in text, text[-3000:]


def _result(label_prefill, label_decode, tokens, margins=None):
    from launch.engine import Generated
    from launch.measure.generate import Run, RunResult

    return RunResult(Run(label_prefill, label_decode), [0.1], [0.2], [0.01], 3, Generated(tokens, margins, 2))


@pytest.mark.parametrize("dtype, margin, failed", [(torch.float32, 0.01, True), (torch.bfloat16, 0.01, False),
                                                   (torch.bfloat16, 0.5, True)])
def test_a_near_tie_that_flips_in_half_precision_is_reported_not_failed(dtype, margin, failed):
    from launch.measure.generate import check

    serial = _result("serial", "serial", [[1, 2, 3], [4, 5, 6]], [[1.0, 1.0, 1.0], [1.0, margin, 1.0]])
    other = _result("two-batch", "two-batch", [[1, 2, 3], [4, 9, 6]])
    failures, notes = check([serial, other], dtype, None)
    where = "first at decode step 1 (0: the prefill's token) of request 1 on rank 0"
    assert bool(failures) == failed and bool(notes) != failed, (failures, notes)
    assert where in (failures + notes)[0]
    if dtype != torch.float32:
        assert f"logit margin there is {margin:.3g}" in (failures + notes)[0]


def test_decode_graph_auto_captures_on_cuda_where_the_run_can_and_runs_eager_steps_elsewhere():
    """``--decode-graph auto`` (the default): the CUDA graphs where the job runs on CUDA over the device cache with
    the reference model (eager steps there are bound by their launches), eager steps on CPU, on Ascend, with
    ``--kv-offload`` and with a transformers model; a path named is taken as it is."""
    import dataclasses

    from launch.config import ConfigError, captured_path, job_config

    job = job_config(world=1, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                     preset_name="tiny", overrides={}, batch=2, seq_len=16, seq_lens=None, dtype="float32", warmup=0,
                     iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=30.0)
    cuda = dataclasses.replace(job, device="cuda")
    assert captured_path(cuda, "auto") == "cuda"
    assert captured_path(job, "auto") is None and captured_path(dataclasses.replace(job, device="npu"), "auto") is None
    assert captured_path(dataclasses.replace(cuda, kv_offload=True), "auto") is None
    assert captured_path(dataclasses.replace(cuda, model_name="qwen3_moe"), "auto") is None
    assert captured_path(cuda, "off") is None and captured_path(job, "cpu") == "cpu"
    with pytest.raises(ConfigError, match="drop --kv-offload"):
        captured_path(dataclasses.replace(job, kv_offload=True), "cpu")


def _parsed(args, capsys, monkeypatch):
    """The job and generation options ``launch/generate.py args`` runs, parsed and checked as the launcher does
    (`run_job` stands in for the run): ``(exit status, job, decode)``."""
    import launch.generate

    seen = {}

    def run_job(job, decode):
        seen.update(job=job, decode=decode)
        return 0

    monkeypatch.setattr(launch.generate, "run_job", run_job)
    code, _, err = run_here(launch.generate.main, TINY + list(args), capsys, monkeypatch)
    assert code == 0, err
    return seen["job"], seen["decode"]


@pytest.mark.parametrize("args, runs", [
    # --decode-mode alone: one prefill (serial), the decode modes compared; auto beside serial
    (["--decode-mode", "auto"], [("serial", "serial"), ("serial", "auto")]),
    (["--decode-mode", "shared,chunked-2"], [("serial", "shared"), ("serial", "chunked-2")]),
    # --mode alone: the decode steps in the same modes; both: paired as given
    ([], [("serial", "serial"), ("shared", "shared"), ("two-batch", "two-batch")]),
    (["--mode", "all", "--decode-mode", "auto"],
     [("serial", "serial"), ("serial", "auto"), ("shared", "auto"), ("two-batch", "auto")]),
    (["--mode", "two-batch", "--decode-mode", "auto"], [("serial", "serial"), ("two-batch", "auto")]),
])
def test_the_runs_a_generation_makes_by_default(args, runs, capsys, monkeypatch):
    """``--decode-mode auto`` with no ``--mode`` runs serial and serial / auto (it ran auto's serial steps after
    three prefill modes, three rows of one schedule); ``--mode`` given is taken as it is."""
    _, decode = _parsed(args, capsys, monkeypatch)
    assert [tuple(r) for r in decode.runs] == runs


def test_generation_takes_the_prefill_options_that_apply_to_it(capsys, monkeypatch):
    """--path auto|npu (the prefill's eager path; npu needs an NPU, as in prefill), --kv-store memory (the host
    cache's store), --refresh-calibration (auto's decode calibration) and the shared ones reach the job; the ranks
    agree on --refresh-calibration."""
    from launch.agreement import fingerprint
    from launch.config import ConfigError, check_generation_options

    job, _ = _parsed(["--path", "auto", "--kv-offload", "--kv-store", "memory", "--refresh-calibration",
                      "--decode-mode", "auto", "--dispatch", "one-step"], capsys, monkeypatch)
    assert job.path is None and job.kv_offload and job.kv_store == "memory" and job.dispatch == "one-step"
    assert job.refresh_calibration and fingerprint(job)["--refresh-calibration"] is True
    check_generation_options("npu", True, "memory", None)  # the eager NPU path: taken
    with pytest.raises(ConfigError, match="--auto-split-margin"):
        check_generation_options("auto", False, "memory", 0.1)
    from launch.generate import main

    code, _, err = run_here(main, TINY + ["--path", "npu"], capsys, monkeypatch)
    assert code == 2 and "--path npu runs on Ascend NPUs only; this run's device is cpu" in err, err


def _calibration_file(stdout):
    return re.search(r"cached after this run in (\S+\.json)\)", stdout).group(1)


def test_auto_says_where_its_calibration_came_from_and_notes_a_stale_one(tmp_path):
    """One process, --decode-mode auto three times over one cache (the conftest's, of this test): measured (its
    file said), then read from the cache with the time it was measured, and from a cache file whose numbers are
    far from this host's (as a calibration measured on a busier host): a note suggesting --refresh-calibration,
    which measures it again. In a log (stderr is no terminal) the progress is a line a calibration round and a
    line a run and round, never a line a step."""
    args = ["--batch", "3", "--seq-len", "8", "--new-tokens", "4", "--decode-mode", "auto",
            "--decode-calibration-rounds", "2", "--warmup", "0", "--iters", "2"]
    first = _run(args)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    assert "calibrating decode (none cached for this machine, model and link; cached after this run in " \
        in first.stdout, first.stdout
    log = first.stderr.splitlines()
    for rnd in (1, 2):  # the calibration's rounds, a line each
        assert sum(line.startswith(f"calibrating decode: round {rnd}/2,") for line in log) == 1, first.stderr
    for run in ("serial", "serial / auto"):  # each run's generations, a line a round
        assert [line.split(",")[0] for line in log if line.startswith(run + ": ")] == \
            [f"{run}: round {r}/2" for r in (1, 2)], first.stderr
    assert not any(", step 1," in line for line in log), first.stderr

    path = _calibration_file(first.stdout)
    data = json.loads(open(path).read())
    data["calibration"]["seconds"] = {mode: [[t * 50 for t in row] for row in rows]
                                      for mode, rows in data["calibration"]["seconds"].items()}
    with open(path, "w") as f:
        json.dump(data, f)
    three_days = 3 * 86400 + 600
    os.utime(path, (os.path.getmtime(path) - three_days,) * 2)
    stale = _run(args)
    assert stale.returncode == 0, stale.stdout + stale.stderr[-3000:]
    assert re.search(r"^decode calibration: cached \(" + re.escape(path) + r"\), measured \d{4}-\d\d-\d\d \d\d:\d\d, 3 "
                     r"days ago$", stale.stdout, re.M), stale.stdout
    assert re.search(r"^serial / auto \(TPOT\): the cached calibration predicted [0-9.]+ ms and this run measured "
                     r"[0-9.]+ ms \(\d+% apart.*--refresh-calibration measures it again$", stale.stdout, re.M), \
        stale.stdout

    refreshed = _run(args + ["--refresh-calibration"])
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr[-3000:]
    assert f"calibrating decode (refreshing; cached after this run in {path})" in refreshed.stdout, refreshed.stdout
    assert "--refresh-calibration measures it again" not in refreshed.stdout, refreshed.stdout  # measured now
