"""The multi-rank harness: results in rank order, failures with tracebacks, hangs named."""
import os
import subprocess
import sys
import time

import pytest

from overlap.multirank import RankFailure, RankTimeout, run_ranks
from support import zygote
from support.ports import free_port
from support.ranks import sum_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_in_rank_order(world):
    out = run_ranks(sum_ranks, world, 2.0)
    total = sum(range(world)) * 2.0
    assert out == [(r, world, total) for r in range(world)]


def _fail_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return ctx.rank


@pytest.mark.spawns_ranks
def test_failure_carries_rank_and_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_ranks(_fail_on_rank1, 2)


def _hang_on_rank1(ctx):
    if ctx.rank == 1:
        time.sleep(120)
    return ctx.rank


@pytest.mark.spawns_ranks
def test_hang_becomes_timeout_naming_ranks():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] of 2 did not finish"):
        run_ranks(_hang_on_rank1, 2, timeout=12)
    assert time.monotonic() - t0 < 60  # the harness must not wait for the sleeper


def _crash_on_rank0(ctx):
    if ctx.rank == 0:
        os._exit(3)
    return ctx.rank


@pytest.mark.spawns_ranks
def test_dead_rank_is_reported():
    with pytest.raises(RankFailure, match="rank 0 died with exit code 3"):
        run_ranks(_crash_on_rank0, 2, timeout=30)


def _env_probe(ctx):
    return os.environ.get("OVERLAP_ENABLE")


@pytest.mark.spawns_ranks
def test_env_reaches_ranks():
    assert run_ranks(_env_probe, 2, env={"OVERLAP_ENABLE": "0"}) == ["0", "0"]


def _environment_probe(ctx):
    return os.environ.get("OVERLAP_TEST_SET_LATER"), "OVERLAP_TEST_REMOVED" in os.environ, \
        os.environ.get("OVERLAP_CALIBRATION_CACHE")


@pytest.mark.spawns_ranks
def test_ranks_run_in_the_callers_environment_of_the_call_not_the_forkservers(monkeypatch):
    """A forkserver's children inherit the environment it started with: ranks of a later call would see an earlier
    caller's variables (a test's calibration cache folder, read by the next test's ranks) and miss the new ones."""
    monkeypatch.setenv("OVERLAP_TEST_REMOVED", "1")
    run_ranks(_environment_probe, 1)  # the forkserver runs from here on, with this environment
    monkeypatch.delenv("OVERLAP_TEST_REMOVED")
    monkeypatch.setenv("OVERLAP_TEST_SET_LATER", "now")
    monkeypatch.setenv("OVERLAP_CALIBRATION_CACHE", "/nonexistent/this-call")
    assert run_ranks(_environment_probe, 2) == [("now", False, "/nonexistent/this-call")] * 2


@pytest.mark.spawns_ranks
def test_under_torchrun_uses_the_existing_group(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "from overlap.multirank import run_ranks\n"
        "from support.ranks import sum_ranks\n"
        "import torch.distributed as dist\n"
        "two = run_ranks(sum_ranks, 2, 1.0)\n"
        "one = run_ranks(sum_ranks, 1, 1.0)\n"
        "print('RESULT', dist.get_rank(), two, one, flush=True)\n" % os.path.join(ROOT, "tests"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "tests"))
    proc = zygote.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(free_port()), str(probe)], timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    # every rank gets every participant's result, as with spawned ranks; rank 1 sits out the 1-rank call
    assert lines == ["RESULT 0 [(0, 2, 1.0), (1, 2, 1.0)] [(0, 1, 0.0)]",
                     "RESULT 1 [(0, 2, 1.0), (1, 2, 1.0)] [(0, 1, 0.0)]"]


BAD_TIMEOUTS = ["abc", "0", "-5", "nan", "inf", "1e400"]


@pytest.fixture(scope="module")
def imported_under_bad_timeouts():
    """One process imports the harness afresh (every ``overlap`` module dropped first) under each of
    `BAD_TIMEOUTS` in turn (a process per value paid torch's import each time): the output, a line per import."""
    code = ("import importlib, os, sys, traceback\n"
            "for value in sys.argv[1:]:\n"
            "    os.environ['OVERLAP_RANK_TIMEOUT'] = value\n"
            "    for name in [m for m in sys.modules if m == 'overlap' or m.startswith('overlap.')]:\n"
            "        del sys.modules[name]\n"
            "    try:\n"
            "        importlib.import_module('overlap.multirank')\n"
            "        print('imported under', repr(value), flush=True)\n"
            "    except Exception:\n"
            "        traceback.print_exc()\n")
    proc = subprocess.run([sys.executable, "-c", code] + BAD_TIMEOUTS, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_a_bad_rank_timeout_is_one_line_naming_the_variable(imported_under_bad_timeouts, monkeypatch, value):
    """Not a float() traceback at import: the harness imports, and each use says which variable is wrong."""
    assert f"imported under {value!r}\n" in imported_under_bad_timeouts, imported_under_bad_timeouts[-2000:]
    monkeypatch.setenv("OVERLAP_RANK_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"OVERLAP_RANK_TIMEOUT='{value}': expected a number of seconds > 0"):
        run_ranks(sum_ranks, 1, 1.0)
    monkeypatch.setenv("OVERLAP_RANK_TIMEOUT", " 12.5 ")
    from overlap.multirank import default_timeout

    assert default_timeout() == 12.5


def test_the_suite_refuses_a_bad_rank_timeout_in_one_line():
    env = dict(os.environ, OVERLAP_RANK_TIMEOUT="abc", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "pytest", os.path.join(ROOT, "tests", "test_multirank.py"), "-q",
                           "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "no_test_has_this_name"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "OVERLAP_RANK_TIMEOUT='abc'" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.spawns_ranks
def test_a_bad_start_method_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("OVERLAP_START_METHOD", "bogus")
    with pytest.raises(ValueError, match="OVERLAP_START_METHOD='bogus': expected one of"):
        run_ranks(sum_ranks, 2, 1.0)


@pytest.mark.spawns_ranks
def test_a_bad_preload_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("OVERLAP_FORKSERVER_PRELOAD", "transformers, not a module")
    with pytest.raises(ValueError, match="OVERLAP_FORKSERVER_PRELOAD=.*'not a module' is not a module name"):
        run_ranks(sum_ranks, 2, 1.0)


def _imported(ctx, names):
    return [n for n in names if n in sys.modules]


@pytest.mark.spawns_ranks
def test_the_ranks_start_with_the_preloaded_modules():
    """The suite's conftest preloads transformers' modeling code into each worker's forkserver: a rank has it
    before its body imports anything (else every rank that builds a transformers model imports it again)."""
    wanted = ["transformers.modeling_utils", "launch.engine"]
    assert run_ranks(_imported, 2, wanted) == [wanted, wanted]
