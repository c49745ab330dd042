"""Naming the rank that stopped: `launch.health.diagnosis` from what the store holds, and the watches that feed it
(`Peers`' signs of life, the launcher's watch of its torchrun agent). See docs/reliability.md, "Faults"."""
import os
import signal
import subprocess
import sys
import time

import pytest

from launch.health import PeerView, diagnosis, process_state

NOW = 1000.0
INTERVAL = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _views(stopped=None, late_by=30.0, steps=(12, 12, 12, 12), process=None):
    """Four ranks at decode step ``steps``; rank ``stopped`` silent for ``late_by`` s, its process ``process``."""
    views = {}
    for r, n in enumerate(steps):
        alive = NOW - (late_by if r == stopped else 0.2)
        views[r] = PeerView(alive, n, f"serial: round 1/1, step {n}", NOW - 5, process if r == stopped else None)
    return views


@pytest.mark.parametrize("me", [0, 1, 3])
def test_a_stopped_rank_is_named_by_every_rank_still_running(me):
    """Before: rank 0 blamed ranks 1 and 3, rank 1 rank 3, rank 3 ranks 0 and 1 (the oldest beat); nobody rank 2."""
    said = diagnosis(me, _views(stopped=2), {}, NOW, INTERVAL)
    assert said.startswith("rank 2 stopped responding (no sign of life for 30.0 s"), said
    assert said.count("rank ") == 1, said


@pytest.mark.parametrize("me", [0, 1, 3])
def test_a_stopped_process_on_this_host_is_said_to_be_stopped(me):
    said = diagnosis(me, _views(stopped=2, late_by=0.2, process="stopped"), {}, NOW, INTERVAL)
    assert said == "rank 2 is stopped (SIGSTOP or a debugger; last seen at serial: round 1/1, step 12, 12 steps made)"


def test_a_killed_rank_is_named_not_peers_are_alive():
    """SIGKILL: its process is gone at once, its signs of life stop a moment later."""
    assert diagnosis(0, _views(stopped=1, late_by=0.2, process="gone"), {}, NOW, INTERVAL).startswith(
        "rank 1 has exited")
    assert diagnosis(0, _views(stopped=1, late_by=2.0), {}, NOW, INTERVAL).startswith("rank 1 stopped responding")


def test_a_slow_rank_alive_but_behind_is_named():
    said = diagnosis(0, _views(steps=(13, 13, 12, 13)), {}, NOW, INTERVAL)
    assert said == ("rank 2 stopped responding (alive, but behind: 12 steps made, rank 0 has made 13; last seen at "
                    "serial: round 1/1, step 12)")
    assert diagnosis(2, _views(steps=(13, 13, 12, 13)), {}, NOW, INTERVAL).startswith("peers are alive")


def test_a_failure_posted_is_said_first_and_nobody_blames_itself():
    assert diagnosis(0, _views(stopped=2), {1: "RuntimeError: boom"}, NOW, INTERVAL) == \
        "rank 1 failed: RuntimeError: boom"
    assert diagnosis(2, _views(stopped=2), {}, NOW, INTERVAL).startswith("peers are alive")


@pytest.mark.parametrize("me", [0, 3])
def test_a_rank_that_only_timed_out_waiting_is_not_blamed_for_the_stopped_one(me):
    """Before: rank 3 said ranks 0 and 1 failed (they had posted their WaitTimeout first)."""
    waited = "WaitTimeout: waited 4 s for 'dispatch' on stream 'default' (a collective) and it has not completed"
    failed = {r: waited for r in (0, 1, 3) if r != me}
    said = diagnosis(me, _views(stopped=2), failed, NOW, INTERVAL)
    assert said.startswith("rank 2 stopped responding"), said
    assert diagnosis(me, _views(), failed, NOW, INTERVAL).startswith(f"rank {min(failed)} failed: WaitTimeout")


def test_without_signs_of_life_the_oldest_progress_is_named():
    views = {r: PeerView(last=f"step {r}", beat_at=NOW - 10 + r) for r in range(3)}
    assert diagnosis(1, views, {}, NOW, INTERVAL) == "rank 0 stopped responding (last seen at step 0)"


def test_process_state_reads_proc_on_this_host():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_state(os.uname().nodename, child.pid) is None
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(os.uname().nodename, child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(os.uname().nodename, child.pid) == "stopped"
        assert process_state("another-host", child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert process_state(os.uname().nodename, child.pid) == "gone"


_ORPHAN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time; from launch.job import watch_launcher; watch_launcher(0.2); print('watching', flush=True); "
    "time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_rank_whose_launcher_is_killed_leaves_with_one_line():
    """Before: the rank computed on for minutes after its torchrun agent was SIGKILLed."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHELASTIC_RUN_ID="test", RANK="1")
    agent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
    rank_pid = int(agent.stdout.readline())
    assert agent.stdout.readline().strip() == "watching"
    agent.kill()
    agent.wait()
    err = agent.stderr.read()  # the end of the pipe the rank holds too: it comes once the rank has left
    assert f"rank 1: its launcher (torchrun agent, pid {agent.pid}) is gone; leaving" in err, err
    assert process_state(os.uname().nodename, rank_pid) in ("gone", None)


def test_fault_iter_counts_the_decode_steps_of_the_measured_rounds():
    """Two runs, one warmup round: its two generations' steps are not counted, then every step is, across runs."""
    from launch.generate import MeasuredSteps

    steps = MeasuredSteps(warmup_generations=2)
    starts = [True, False, False, True, False, True, False, False, True, False]  # 4 generations' steps
    assert [steps.number(s) for s in starts] == [None] * 5 + [0, 1, 2, 3, 4]
