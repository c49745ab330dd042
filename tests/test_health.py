"""Naming the rank that stopped: `launch.health.diagnosis` from what the store holds, and the watches that feed it
(`Peers`' signs of life, the launcher's watch of its torchrun agent). See docs/reliability.md, "Faults"."""
import os
import signal
import subprocess
import sys
import time

import pytest

from overlap.peers import PeerView, diagnosis, process_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _views(stopped=None, silent=True, steps=(12, 12, 12, 12), process=None):
    """Four ranks at decode step ``steps``; rank ``stopped`` ``silent`` (no sign of life while looked at), its
    process ``process``."""
    return {r: PeerView(not (r == stopped and silent), n, f"serial: round 1/1, step {n}", 995.0,
                        process if r == stopped else None) for r, n in enumerate(steps)}


@pytest.mark.parametrize("me", [0, 1, 3])
def test_a_stopped_rank_is_named_by_every_rank_still_running(me):
    """Before: rank 0 blamed ranks 1 and 3, rank 1 rank 3, rank 3 ranks 0 and 1 (the oldest beat); nobody rank 2."""
    said = diagnosis(me, _views(stopped=2))
    assert said.startswith("rank 2 stopped responding (no sign of life; last seen at"), said
    assert said.count("rank ") == 1, said


@pytest.mark.parametrize("me", [0, 1, 3])
def test_a_stopped_process_on_this_host_is_said_to_be_stopped(me):
    said = diagnosis(me, _views(stopped=2, silent=False, process="stopped"))
    assert said == "rank 2 is stopped (SIGSTOP or a debugger; last seen at serial: round 1/1, step 12, 12 steps made)"


def test_a_killed_rank_is_named_not_peers_are_alive():
    """SIGKILL: its process is gone at once, its signs of life stop a moment later."""
    assert diagnosis(0, _views(stopped=1, silent=False, process="gone")).startswith(
        "rank 1 has exited")
    assert diagnosis(0, _views(stopped=1)).startswith("rank 1 stopped responding")


def test_a_slow_rank_alive_but_behind_is_named():
    said = diagnosis(0, _views(steps=(13, 13, 12, 13)))
    assert said == ("rank 2 stopped responding (alive, but behind: 12 steps made, rank 0 has made 13; last seen at "
                    "serial: round 1/1, step 12)")
    assert diagnosis(2, _views(steps=(13, 13, 12, 13))).startswith("peers are alive")


def test_a_failure_posted_is_said_first_and_nobody_blames_itself():
    assert diagnosis(0, _views(stopped=2), {1: "RuntimeError: boom"}) == \
        "rank 1 failed: RuntimeError: boom"
    assert diagnosis(2, _views(stopped=2)).startswith("peers are alive")


@pytest.mark.parametrize("me", [0, 3])
def test_a_rank_that_only_timed_out_waiting_is_not_blamed_for_the_stopped_one(me):
    """Before: rank 3 said ranks 0 and 1 failed (they had posted their WaitTimeout first)."""
    waited = "WaitTimeout: waited 4 s for 'dispatch' on stream 'default' (a collective) and it has not completed"
    failed = {r: waited for r in (0, 1, 3) if r != me}
    said = diagnosis(me, _views(stopped=2), failed)
    assert said.startswith("rank 2 stopped responding"), said
    assert diagnosis(me, _views(), failed).startswith(f"rank {min(failed)} failed: WaitTimeout")


def test_without_signs_of_life_the_oldest_progress_is_named():
    views = {r: PeerView(last=f"step {r}", beat_at=990.0 + r) for r in range(3)}
    assert diagnosis(1, views) == "rank 0 stopped responding (last seen at step 0)"


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


def test_a_peer_watch_tells_a_silent_rank_from_a_waiting_one_and_one_behind(monkeypatch):
    """Two watches over one store, as two ranks: while both give signs, none is late; a rank a step behind is
    named; once one stops giving signs (its interpreter held, SIGSTOP), it is named silent, whatever the clocks."""
    import torch.distributed as dist

    from overlap import peers

    monkeypatch.setattr(peers, "STALE", 4)
    store = dist.HashStore()
    watches = [peers.PeerWatch(store, r, 2, interval=0.02) for r in range(2)]
    for w in watches:
        w.start()
    try:
        assert peers.diagnosis(0, watches[0].views()).startswith("peers are alive")
        watches[0].step()
        assert peers.diagnosis(0, watches[0].views()).startswith(
            "rank 1 stopped responding (alive, but behind: 0 steps made, rank 0 has made 1")
        watches[1].step()
        watches[1].stop()
        time.sleep(0.1)
        views = watches[0].views()
        assert views[1].alive is False and views[0].alive is True
        assert peers.diagnosis(0, views).startswith("rank 1 stopped responding (no sign of life")
    finally:
        for w in watches:
            w.stop()


def _late_in_generate(ctx):
    """Rank 1 is held 6 s inside a decode step (``on_step``) and says in the store when it wakes; rank 0, bounded at
    2 s, must give up naming it, before rank 1 woke: (its message, whether rank 1 had woken by then)."""
    import torch.distributed as dist

    import overlap
    from launch.engine import generate, make_expert_parallel
    from launch.models import build_model, preset

    model = make_expert_parallel(build_model(preset("tiny"), seed=0), ctx.group)
    store = dist.distributed_c10d._get_default_store()

    def on_step(step, active):
        if ctx.rank == 1 and step == 1:
            time.sleep(6)
            store.set("rank1_woke", "1")

    overlap.set_wait_timeout(2)
    try:
        generate(model, [[1, 2, 3, 4], [5, 6, 7]], 4, on_step=on_step)
        return None, None
    except overlap.WaitTimeout as exc:
        return str(exc), store.check(["rank1_woke"])
    except RuntimeError as exc:  # rank 1, woken: rank 0 has given up and gone
        assert ctx.rank == 1, exc
        return None, None


@pytest.mark.spawns_ranks
@pytest.mark.timeout(120)
def test_a_wait_in_the_generation_api_runs_out_within_the_bound_naming_the_rank_behind():
    """Issue 57: a program that set `overlap.set_wait_timeout(10)` waited the whole 30 s of a peer's sleep (gloo's
    own 30-minute wait). Now rank 0's wait ends at the bound, and its message names rank 1, alive but a step
    behind (`overlap.watch_peers`, started by `generate`)."""
    from overlap.multirank import run_ranks

    (said, woken), _ = run_ranks(_late_in_generate, 2, timeout=90)
    assert said is not None and not woken, "rank 0 waited for rank 1's sleep instead of giving up at the bound"
    assert "rank 1 stopped responding (alive, but behind" in said, said
