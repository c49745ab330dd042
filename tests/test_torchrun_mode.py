"""The suite's torchrun mode, run on a small suite of its own: outcomes decided together, one report.

Each case starts torchrun (gloo on CPU) over a generated test folder whose conftest loads the
same plugin as the real suite (tests/support/torchrun_mode.py), with tests that pass, fail on one rank
only, fail in a body while the peer waits in a collective, skip on one rank only, and run on a
subgroup; then checks what rank 0 reported and the exit status. Another suite freezes a rank
(SIGSTOP) in the middle of a test, as a hung node would be.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from support import zygote
from support.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spawns_ranks

CONFTEST = '''
import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    from support.torchrun_mode import TorchrunMode

    config.pluginmanager.register(TorchrunMode(config), "overlap-torchrun-mode")
'''

SUITE = '''
import os

import pytest
import torch
import torch.distributed as dist

from overlap.multirank import RankFailure, run_ranks


def _rank():
    return int(os.environ["RANK"])


def _sum(ctx):
    x = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(x, group=ctx.group)
    return ctx.rank, x.item()


def _fails_on_1_before_the_collective(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group)  # rank 0 waits here for a peer that never comes
    return x.item()


def test_a_every_rank_gets_every_result():
    world = int(os.environ["WORLD_SIZE"])
    assert run_ranks(_sum, world) == [(r, world * (world + 1) / 2) for r in range(world)]


def test_b_fails_on_rank_1_only():
    assert _rank() != 1, "only rank 1 fails this"


def test_c_body_fails_while_the_peer_waits():
    # rank 0 waits out its group's timeout in the collective: 4 s of idling, not OVERLAP_RANK_TIMEOUT's 10
    with pytest.raises(RankFailure, match="rank 1 refuses"):
        run_ranks(_fails_on_1_before_the_collective, 2, timeout=4)
    raise AssertionError("seen on every rank")


@pytest.mark.skipif(_rank() == 1, reason="rank 1 has no such thing")
def test_d_skips_on_rank_1_only():
    assert False, "never runs: rank 1 skips it, so every rank does"


def test_d2_skips_inside_on_rank_1_only():
    if _rank() == 1:
        pytest.skip("decided inside the test")


def test_e_subgroup_of_one():
    assert run_ranks(_sum, 1) == [(0, 1.0)]  # every rank, taking part or not, gets rank 0's result


def test_f_the_suite_went_on():
    assert run_ranks(_sum, 2) == [(0, 3.0), (1, 3.0)]
'''


def _suite(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               OVERLAP_RANK_TIMEOUT="10", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def _pytest_args(tmp_path):
    return ["-m", "pytest", str(tmp_path), "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfs",
            "--rootdir", str(tmp_path)]


def _check_report(out: str, world: int) -> None:
    assert out.count("torchrun mode:") == 1, out[-4000:]  # one report, from rank 0
    assert f"torchrun mode: {world} ranks" in out
    assert "FAILED test_suite.py::test_b_fails_on_rank_1_only on rank(s) 1" in out, out[-4000:]
    assert f"FAILED test_suite.py::test_c_body_fails_while_the_peer_waits on rank(s) " \
           f"{', '.join(map(str, range(world)))}" in out
    # rank 0 ran neither body, yet reports both as skipped, with rank 1's reason
    assert "skipped on rank 1: rank 1 has no such thing" in out, out[-4000:]
    assert "skipped on rank 1: decided inside the test" in out
    assert "test_d_skips_on_rank_1_only on rank" not in out  # skipped everywhere, failed nowhere
    assert "2 failed, 3 passed, 2 skipped" in out, out[-4000:]


# 3 ranks: more than the 2 of the subgroup tests, so that a rank takes no part (4 cost a rank's pytest session more,
# ~25% of this test, for nothing 3 does not check); 2 ranks: test_two_agents_as_two_nodes, and CI runs the suite so
@pytest.mark.parametrize("world", [3])
def test_one_agent(tmp_path, world):
    env = _suite(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(free_port())] + _pytest_args(tmp_path)
    proc = zygote.run(cmd, env=env, cwd=str(tmp_path), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]  # a rank failed: the job fails
    _check_report(proc.stdout, world)


def test_two_agents_as_two_nodes(tmp_path):
    """``--nnodes 2`` with a c10d rendezvous on one host: what a two-node run looks like."""
    env = _suite(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "suite"]
    agents = [zygote.Popen(cmd + ["--node-rank", str(n)] + _pytest_args(tmp_path), env=env, cwd=str(tmp_path))
              for n in range(2)]
    outs = []
    try:
        for a in agents:
            out, err = a.communicate(timeout=240)
            outs.append((a.returncode, out, err))
    finally:
        for a in agents:
            a.kill()
    assert all(rc != 0 for rc, _, _ in outs), outs  # every agent reports the failure
    reports = [out for _, out, _ in outs if "torchrun mode:" in out]
    assert len(reports) == 1, outs  # rank 0's agent prints the one report
    _check_report(reports[0], 2)


def test_ranks_that_collected_different_tests_stop_before_running_any(tmp_path):
    env = _suite(tmp_path)
    (tmp_path / "conftest.py").write_text(CONFTEST + '''

def pytest_collection_modifyitems(items):
    import os

    if os.environ["RANK"] == "1":  # say, a file that fails to import on one node only
        del items[0]
''')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port())] + _pytest_args(tmp_path)
    proc = zygote.run(cmd, env=env, cwd=str(tmp_path), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "the ranks collected different tests (rank 0: 7 tests" in out and "rank 1: 6 tests" in out, out[-4000:]
    assert "passed" not in proc.stdout  # nothing ran


FROZEN_CONFTEST = CONFTEST + '''

import os

_OUT = os.environ["FROZEN_OUT"]
with open(os.path.join(_OUT, f"pid-{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.path.join(_OUT, f"failed-{os.environ['RANK']}"), "a") as f:
            f.write(f"{report.nodeid} {report.when}\\n")


def pytest_sessionfinish(session, exitstatus):
    with open(os.path.join(_OUT, f"status-{os.environ['RANK']}"), "w") as f:
        f.write(str(int(exitstatus)))
'''

FROZEN_SUITE = '''
import os
import signal
import time

import torch
import torch.distributed as dist

from overlap.multirank import run_ranks


def _sum(ctx):
    x = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(x, group=ctx.group)
    return x.item()


def test_a_together():
    world = int(os.environ["WORLD_SIZE"])
    assert run_ranks(_sum, world) == [world * (world + 1) / 2] * world


def test_b_a_rank_freezes():
    if os.environ["RANK"] == os.environ["FROZEN_RANK"]:
        if os.environ["FAULT"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # a frozen node: no exit, no message, no heartbeat
        else:
            time.sleep(600)  # alive, but far behind its peers


def test_c_never_runs():
    pass
'''


def _kill_rank(out, marker, rank):
    """SIGKILL rank ``rank`` of this run if it is still there."""
    try:
        pid = int(open(os.path.join(out, f"pid-{rank}")).read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker.encode() not in f.read():
                return  # not ours any more
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _kill_leftovers(out, marker):
    """SIGKILL the ranks of this run that are still there (the frozen one, unless torchrun killed it)."""
    for name in os.listdir(out):
        if name.startswith("pid-"):
            _kill_rank(out, marker, name[len("pid-"):])


@pytest.mark.parametrize("fault, frozen", [("stop", 0), ("sleep", 1)])  # each fault; rank 0 and another
def test_a_frozen_rank_is_named_and_fails_the_test_on_every_other_rank(tmp_path, fault, frozen):
    """A rank stopped with SIGSTOP mid-test: every other rank names it within OVERLAP_RANK_TIMEOUT (7 s
    here; OVERLAP_TEST_TIMEOUT stays at its 900 s), fails that test, stops the suite and exits 1; the
    summary names the rank and the test (before: nothing for 900 s, then a warning and "no test failed").
    A rank alive but far behind is named the same way after OVERLAP_TEST_TIMEOUT (5 s here)."""
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    env = _suite(suite)
    (suite / "conftest.py").write_text(FROZEN_CONFTEST)
    (suite / "test_suite.py").write_text(FROZEN_SUITE)
    env.update(FROZEN_OUT=str(out), FROZEN_RANK=str(frozen), FAULT=fault, OVERLAP_RANK_TIMEOUT="7")
    env.pop("OVERLAP_TEST_TIMEOUT", None)
    if fault == "sleep":
        env["OVERLAP_TEST_TIMEOUT"] = "5"
    world = 3
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(free_port())] + _pytest_args(suite)
    proc = zygote.Popen(cmd, env=env, cwd=str(suite))  # in a session of its own
    live = [r for r in range(world) if r != frozen]
    try:
        # once every live rank has ended its session, end the frozen one: torchrun would, after its grace period
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and \
                not all((out / f"status-{r}").exists() for r in live):
            time.sleep(0.2)
        _kill_rank(str(out), str(suite), frozen)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_leftovers(str(out), str(suite))
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the job did not end within 180 s of the fault ({fault} on rank {frozen}): no rank noticed "
                    f"it\n{stdout[-3000:]}")
    finally:
        _kill_leftovers(str(out), str(suite))
    assert proc.returncode != 0, stdout[-3000:]
    report = stdout if frozen else stderr  # rank 0 reports; when it is the frozen one, the lowest rank left does
    if fault == "stop":
        named, note = f"rank {frozen} stopped responding: no sign of life for", f"rank {frozen} stopped responding"
    else:
        named = f"ranks [{frozen}] of {world} did not reach 'pytest/5' within 5s (alive, but hung"
        note = f"rank {frozen} did not finish it within OVERLAP_TEST_TIMEOUT 5 s"
    assert named in report, (stdout[-4000:], stderr[-4000:])
    assert f"FAILED test_suite.py::test_b_a_rank_freezes on rank(s) {', '.join(map(str, live))} ({note})" in report, \
        (stdout[-4000:], stderr[-4000:])
    assert "no test failed on any rank" not in report and "PluggyTeardownRaisedWarning" not in stdout + stderr
    for r in live:  # the test in progress failed on every rank still running, and each stopped there with 1
        assert (out / f"failed-{r}").read_text() == "test_suite.py::test_b_a_rank_freezes call\n", r
        assert (out / f"status-{r}").read_text() == "1", r
    assert not (out / f"status-{frozen}").exists()
    if frozen:  # rank 0's own report
        assert "1 failed, 1 passed" in stdout and "test_c_never_runs" not in stdout, stdout[-4000:]
