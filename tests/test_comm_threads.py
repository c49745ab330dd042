"""On request the CPU path's communication threads run real-time, compute threads never (`overlap.comm_threads`).

Checked by the scheduling policy the kernel reports for each thread, never by a timing.
"""
import os
import threading
import time

import pytest
import torch

import overlap
from overlap import EP_COMM, comm_threads
from overlap import link as link_mod
from overlap.multirank import run_ranks

pytestmark = pytest.mark.cpu_only
linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread policies are read from /proc")


def _policies():
    """(native id, name, policy) of every thread of this process."""
    out = []
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            out.append((tid, comm_threads._thread_name(tid), os.sched_getscheduler(tid)))
        except ProcessLookupError:
            pass
    return out


def _exchange(ctx, side_stream=False):
    x = torch.ones(40 * ctx.world_size, 64)  # 10 KB to each peer
    out = torch.empty_like(x)
    if side_stream:
        ev = overlap.event("comm_threads_test")
        with overlap.stream(EP_COMM):
            overlap.all_to_all_single(out, x, group=ctx.group, name="side")
            ev.record(out)
        ev.wait(out)
    else:
        overlap.all_to_all_single(out, x, group=ctx.group, name="main")
    return out


def _policies_around_exchanges(ctx):
    main = threading.get_native_id()
    overlap.set_comm_priority("rt")
    overlap.set_link(overlap.Link(gbps=1e-3))
    try:
        _exchange(ctx, side_stream=True)
        # the link's clock thread starts when a transfer's bytes arrive before its booking ends, which
        # depends on the host's load: start it here, and wait (bounded) until it has enrolled itself
        link_mod._CLOCK.at(time.perf_counter(), lambda: None)
        deadline = time.monotonic() + 10
        while link_mod._CLOCK._thread.native_id not in comm_threads._REG.enrolled and time.monotonic() < deadline:
            time.sleep(0.01)
        _exchange(ctx)  # the look after the clock thread started
        raised = _policies()
        clock = link_mod._CLOCK._thread.native_id if link_mod._CLOCK._thread is not None else None
        said = overlap.describe_comm_priority()
        overlap.set_comm_priority("off")
        lowered = _policies()
    finally:
        overlap.set_link(None)
        overlap.set_comm_priority(None)
    debug = (sorted(comm_threads._REG.raised), comm_threads._REG.applied, len(comm_threads._REG.seen_tasks))
    return {"debug": debug, "main": main, "clock": clock, "raised": raised, "lowered": lowered, "said": said,
            "unavailable": comm_threads._REG.unavailable}


@linux
def test_gloo_and_link_threads_run_real_time_and_compute_does_not():
    for r in run_ranks(_policies_around_exchanges, 2, timeout=60):
        if r["unavailable"]:
            pytest.skip(f"real-time threads are not possible here: {r['unavailable']}")
        policy = {tid: p for tid, _, p in r["raised"]}
        names = {tid: n for tid, n, _ in r["raised"]}
        gloo = [tid for tid, n in names.items() if n in comm_threads.COMM_THREAD_NAMES]
        assert gloo, f"no gloo thread found among {sorted(set(names.values()))}"
        assert all(policy[t] == os.SCHED_FIFO for t in gloo), (
            [(t, names[t], policy[t]) for t in gloo if policy[t] != os.SCHED_FIFO], r.get("debug"))
        assert r["clock"] is not None and policy.get(r["clock"]) == os.SCHED_FIFO, (r["clock"], r["raised"])
        assert policy[r["main"]] == os.SCHED_OTHER  # the compute thread keeps its share
        others = [t for t in policy if t not in gloo and t not in (r["clock"], r["main"])]
        assert all(policy[t] != os.SCHED_FIFO for t in others), r["raised"]
        assert r["said"].startswith("real-time"), r["said"]
        # turned off: every thread back to normal
        assert all(p == os.SCHED_OTHER for _, _, p in r["lowered"]), r["lowered"]


@pytest.fixture
def registry(monkeypatch):
    """A fresh registry, so a test's refusals and raised threads do not outlive it."""
    fresh = comm_threads._Registry()
    monkeypatch.setattr(comm_threads, "_REG", fresh)
    monkeypatch.setattr(comm_threads, "COMM_THREAD_NAMES", ())  # only the enrolled thread (torchrun mode has gloo's)
    monkeypatch.setattr(comm_threads.STATE, "comm_priority", None)
    monkeypatch.delenv(comm_threads.ENV_COMM_PRIORITY, raising=False)
    return fresh


def _in_enrolled_thread(fn):
    """Run ``fn`` while a thread enrolled as a communication thread is alive."""
    enrolled, done = threading.Event(), threading.Event()

    def comm():
        comm_threads.enrol_current_thread()
        enrolled.set()
        done.wait(10)

    t = threading.Thread(target=comm)
    t.start()
    try:
        assert enrolled.wait(10)
        return fn(t.native_id)
    finally:
        done.set()
        t.join(10)


@linux
def test_a_refused_raise_is_said_once_and_nothing_fails(registry, monkeypatch):
    monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "rt")
    calls = []

    def refuse(tid, policy, param):
        calls.append(tid)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)

    def check(tid):
        assert comm_threads.prioritize_comm_threads() == 0
        assert comm_threads.prioritize_comm_threads() == 0  # no second try
        assert calls == [tid]  # tried once, then no more
        assert overlap.comm_priority() == "off"
        assert "not permitted" in overlap.describe_comm_priority()

    _in_enrolled_thread(check)


@linux
def test_enrolled_thread_raised_then_lowered(registry, monkeypatch):
    monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "rt")
    policies = {}
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: policies.__setitem__(tid, policy))
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: policies.get(tid, os.SCHED_OTHER))

    def check(tid):
        assert comm_threads.prioritize_comm_threads() == 1
        assert policies == {tid: os.SCHED_FIFO}
        assert threading.get_native_id() not in policies  # the caller computes: never raised
        overlap.set_comm_priority("off")
        assert policies == {tid: os.SCHED_OTHER} and comm_threads.raised_threads() == set()
        monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "off")
        overlap.set_comm_priority(None)  # the environment's: still off
        assert policies[tid] == os.SCHED_OTHER and overlap.comm_priority() == "off"

    _in_enrolled_thread(check)


def test_a_thread_replaced_one_for_one_is_still_found(registry, monkeypatch):
    """A process group destroyed and another created keep the thread count (torchrun mode's groups)."""
    monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "rt")
    listing = ["101", "102"]
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: list(listing) if p == comm_threads._TASKS else real_listdir(p))
    monkeypatch.setattr(comm_threads, "COMM_THREAD_NAMES", ("gloo_tcp_loop",))
    monkeypatch.setattr(comm_threads, "_thread_name", lambda tid: "gloo_tcp_loop" if tid != 101 else "python")
    policies = {}
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: policies.__setitem__(tid, policy))
    assert comm_threads.prioritize_comm_threads() == 1 and policies == {102: os.SCHED_FIFO}
    listing[1] = "103"  # 102 ended, 103 started: the same count
    assert comm_threads.prioritize_comm_threads() == 1
    assert policies == {102: os.SCHED_FIFO, 103: os.SCHED_FIFO} and comm_threads.raised_threads() == {103}


def test_a_thread_that_names_itself_late_is_still_found(registry, monkeypatch):
    """gloo's threads set their names a moment after they start: the looks after a start check again."""
    monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "rt")
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: ["101", "102"] if p == comm_threads._TASKS else real_listdir(p))
    monkeypatch.setattr(comm_threads, "COMM_THREAD_NAMES", ("pt_gloo_runloop",))
    names = {101: "python", 102: "python"}  # 102 not yet named
    monkeypatch.setattr(comm_threads, "_thread_name", lambda tid: names[tid])
    policies = {}
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: policies.__setitem__(tid, policy))
    assert comm_threads.prioritize_comm_threads() == 0
    names[102] = "pt_gloo_runloop"
    assert comm_threads.prioritize_comm_threads() == 1 and policies == {102: os.SCHED_FIFO}


def test_normal_priority_by_default(registry, monkeypatch):
    """Real-time threads lose beside another job on a shared host: nothing is raised unless asked for."""
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: pytest.fail("a thread was raised by default"))

    def check(tid):
        assert comm_threads.prioritize_comm_threads() == 0 and overlap.comm_priority() == "off"
        assert overlap.describe_comm_priority() == "normal priority"

    _in_enrolled_thread(check)


def test_off_lists_no_thread_once_nothing_is_raised(registry, monkeypatch):
    """Off (the default) costs a collective nothing after the first look; switched back from rt, it looks once more."""
    listed = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: listed.append(p) or real_listdir(p))
    for _ in range(3):
        assert comm_threads.prioritize_comm_threads() == 0
    assert listed.count(comm_threads._TASKS) == 1
    policies = {}
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: policies.__setitem__(tid, policy))
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: policies.get(tid, os.SCHED_OTHER))

    def check(tid):
        overlap.set_comm_priority("rt")
        assert policies == {tid: os.SCHED_FIFO}
        overlap.set_comm_priority("off")  # lowered by a look of its own
        assert policies == {tid: os.SCHED_OTHER}
        before = listed.count(comm_threads._TASKS)
        assert comm_threads.prioritize_comm_threads() == 0 and listed.count(comm_threads._TASKS) == before

    _in_enrolled_thread(check)


def test_reset_forgets_the_setting(registry):
    overlap.set_comm_priority("rt")
    assert comm_threads.requested_mode() == "rt"
    overlap.reset()
    assert comm_threads.requested_mode() == "off"  # the environment's (unset: the default, off)


def test_bad_modes_are_refused_by_name(registry, monkeypatch):
    with pytest.raises(ValueError, match="set_comm_priority: expected one of rt, off"):
        overlap.set_comm_priority("fifo")
    monkeypatch.setenv(comm_threads.ENV_COMM_PRIORITY, "high")
    with pytest.raises(ValueError, match="OVERLAP_CPU_COMM_PRIORITY"):
        comm_threads.requested_mode()


def test_launcher_option_reaches_the_job_and_its_agreement():
    from launch.agreement import fingerprint
    from launch.config import job_config

    common = dict(world=2, device="cpu", exec_path="auto", mode="all", kv_offload=False, kv_store="memory",
                  preset_name="tiny", overrides={}, batch=2, seq_len=16, seq_lens=None, dtype="float32", warmup=0,
                  iters=1, seed=0, check=False, out_dir=None, cpu_link="0.1", timeout=30.0)
    assert job_config(**common).comm_priority == "off"  # real-time only on request
    rt = job_config(**common, cpu_comm_priority="rt")
    assert rt.comm_priority == "rt"
    assert fingerprint(rt)["--cpu-comm-priority"] == "rt"
