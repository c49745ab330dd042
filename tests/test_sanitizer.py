"""The stream sanitizer: a missing wait is caught on CPU, the correct schedule is clean, results unchanged."""
import os
import subprocess
import sys

import pytest
import torch

import overlap
from overlap import EP_COMM, KV_OFFLOAD, DEFAULT, SHARED_EXPERT, Sanitizer, StreamRaceError
from overlap.multirank import run_ranks

pytestmark = pytest.mark.cpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _cpu():
    overlap.set_path("cpu")
    yield
    overlap.synchronize()


def _offload(src: torch.Tensor, wait: bool) -> torch.Tensor:
    """Copy on the offload stream, then use the copy on the main stream (with or without the wait)."""
    dst = torch.empty_like(src)
    ev = overlap.event("test_offload")
    with overlap.stream(KV_OFFLOAD):
        overlap.copy_(dst, src)
        ev.record()
    if wait:
        dst = ev.wait(dst)
    return dst * 2


def test_missing_wait_after_copy_is_caught():
    src = torch.randn(32, 16)
    with pytest.raises(StreamRaceError) as err:
        with Sanitizer():
            _offload(src, wait=False)
    race = err.value.race
    assert race.kind == "read after write"
    assert (race.previous.stream, race.previous.op) == (KV_OFFLOAD, "copy")
    assert race.current.stream == DEFAULT and "mul" in race.current.op
    assert race.shape == (32, 16)
    for word in (KV_OFFLOAD, DEFAULT, "copy", "mul", "(32, 16)"):
        assert word in str(err.value)


def test_correct_copy_is_clean_and_results_unchanged():
    src = torch.randn(32, 16)
    expected = _offload(src, wait=True)
    with Sanitizer() as san:
        got = _offload(src, wait=True)
    assert san.races == []
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, src * 2)


def _shared_expert(x: torch.Tensor, w: torch.Tensor, wait: bool) -> torch.Tensor:
    """The shared expert on its own stream beside main-stream work, then summed on main."""
    start, done = overlap.event("test_shared_in"), overlap.event("test_shared_out")
    h = torch.relu(x)
    start.record()
    with overlap.stream(SHARED_EXPERT):
        start.wait()
        s = h @ w
        done.record()
    r = h * 3
    if wait:
        done.wait()
    return r + s


def test_inline_compute_on_side_stream_needs_its_wait():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    expected = _shared_expert(x, w, wait=True)
    with Sanitizer() as san:
        got = _shared_expert(x, w, wait=True)
    assert san.races == []
    torch.testing.assert_close(got, expected)
    with Sanitizer(raise_on_race=False) as san:
        _shared_expert(x, w, wait=False)
    assert [(r.kind, r.previous.stream, r.current.stream) for r in san.races] == [
        ("read after write", SHARED_EXPERT, DEFAULT)]
    assert "mm" in san.races[0].previous.op and "add" in san.races[0].current.op


def _read_after_side_write(wait_for: str) -> Sanitizer:
    """The shared-expert stream writes ``y`` between two records; main waits for ``wait_for``, then reads ``y``."""
    x = torch.randn(8)
    events = {n: overlap.event(f"test_order_{n}") for n in ("before", "after", "elsewhere")}
    with Sanitizer(raise_on_race=False) as san:
        with overlap.stream(KV_OFFLOAD):
            x.sum()
            events["elsewhere"].record()  # a stream that never touches y
        with overlap.stream(SHARED_EXPERT):
            events["before"].record()  # recorded before the write: orders nothing of it
            y = x * 2
            events["after"].record()  # recorded after the write (and last): the one to wait for
        events[wait_for].wait()
        y.sum()
    return san


def test_only_a_wait_for_the_event_recorded_after_the_write_orders_the_read():
    assert _read_after_side_write("after").races == []


@pytest.mark.parametrize("wait_for", ["before", "elsewhere"])
def test_a_wait_for_another_event_is_still_a_race(wait_for):
    """Negative control: waiting for an event, but not the one recorded after the writer, orders nothing."""
    races = _read_after_side_write(wait_for).races
    assert [(r.kind, r.previous.stream, r.current.stream) for r in races] == [
        ("read after write", SHARED_EXPERT, DEFAULT)]
    assert "mul" in races[0].previous.op and "sum" in races[0].current.op


def test_write_after_read_and_synchronize():
    x = torch.randn(16)
    out = torch.empty(16)
    with Sanitizer(raise_on_race=False) as san:
        with overlap.stream(KV_OFFLOAD):
            overlap.copy_(out, x)  # reads x on the copy stream
        x.add_(1)  # overwrites x on main before the copy is known to be done
    assert [r.kind for r in san.races] == ["write after read"]
    assert san.races[0].previous.stream == KV_OFFLOAD
    with Sanitizer() as san:
        with overlap.stream(KV_OFFLOAD):
            overlap.copy_(out, x)
        overlap.synchronize()  # the host waited for everything
        x.add_(1)
        out.sum()
    assert san.races == []


def test_allocation_is_not_a_write_and_views_are_not_accesses():
    src = torch.randn(4, 6)
    with Sanitizer() as san:
        buf = torch.empty(6, 4).t()  # allocated and viewed on main, filled on the copy stream
        ev = overlap.event("test_alloc")
        with overlap.stream(KV_OFFLOAD):
            overlap.copy_(buf, src)
            ev.record()
        ev.wait()
        total = buf.sum()
    assert san.races == []
    torch.testing.assert_close(total, src.sum())


def test_disabled_overlap_is_single_stream_and_clean():
    src = torch.randn(5, 3)
    with overlap.enabled(False), Sanitizer() as san:
        got = _offload(src, wait=False)
    assert san.races == []
    torch.testing.assert_close(got, src * 2)


def test_environment_variable_enables_test_mode():
    script = ("import torch, overlap\n"
              "overlap.sanitize_from_env()\n"  # a program opts in once; importing overlap does nothing
              "overlap.set_path('cpu')\n"
              "src = torch.randn(4); dst = torch.empty(4)\n"
              "with overlap.stream(overlap.KV_OFFLOAD):\n"
              "    overlap.copy_(dst, src)\n"
              "print((dst + 1).sum())\n")
    env = dict(os.environ, OVERLAP_SANITIZE="raise", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "StreamRaceError" in proc.stderr and "kv_offload" in proc.stderr
    env["OVERLAP_SANITIZE"] = "bogus"
    proc = subprocess.run([sys.executable, "-c", "import overlap; print('imported', flush=True); "
                           "overlap.sanitize_from_env()"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "imported\n", proc.stderr[-2000:]  # no side effect at import
    assert proc.returncode != 0 and "OVERLAP_SANITIZE" in proc.stderr


def _dispatch(ctx, x: torch.Tensor, wait: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    ready, sent = overlap.event("test_a2a_ready"), overlap.event("test_a2a_sent")
    ready.record()
    with overlap.stream(EP_COMM):
        ready.wait()
        overlap.all_to_all_single(out, x, group=ctx.group, name="dispatch")
        sent.record()
    y = torch.ones(4, 4) @ torch.ones(4, 4)  # independent main-stream work
    if wait:
        out = sent.wait(out)
    return out * 2 + y.sum()


def _rank_body(ctx, mode: str):
    torch.manual_seed(ctx.rank)
    overlap.set_path("cpu")
    x = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 100 * ctx.rank
    serial = overlap.enabled(False)
    with serial:
        reference = _dispatch(ctx, x, wait=True)
    if mode == "correct":
        with Sanitizer() as san:
            got = _dispatch(ctx, x, wait=True)
        overlap.synchronize()
        return reference, got, [str(r) for r in san.races]
    with Sanitizer(raise_on_race=False) as san:
        got = _dispatch(ctx, x, wait=False)
    overlap.synchronize()
    return reference, None, [(r.kind, r.previous.stream, r.previous.op, r.current.stream, r.shape)
                             for r in san.races]


def test_all_to_all_schedule_clean_and_unchanged():
    for reference, got, races in run_ranks(_rank_body, 2, "correct", timeout=60):
        assert races == []
        torch.testing.assert_close(got, reference)


def test_all_to_all_missing_wait_is_caught():
    for _, _, races in run_ranks(_rank_body, 2, "missing", timeout=60):
        assert ("read after write", EP_COMM, "dispatch", DEFAULT, (8, 3)) in races


def test_a_freed_storage_does_not_leave_its_history_at_a_reused_address():
    """torch.tensor() allocates without a dispatched op, so address reuse must be caught by the storage going away."""
    from overlap.observability.sanitizer import _storage_key

    with Sanitizer(raise_on_race=True) as san:
        a = torch.empty(4)  # an allocation, not a write
        san._access(EP_COMM, "side_write", (), (a,))
        old = _storage_key(a)
        b = torch.tensor([1.0, 2.0, 3.0, 4.0])
        del a  # freed: an unrelated tensor may now get its address
        san._history[_storage_key(b)] = san._history.pop(old)  # emulate that reuse
        b.add_(1)  # on the main stream, without any edge to the side stream: no race, it is new memory
    assert not san.races


def test_a_live_storage_keeps_its_history():
    with pytest.raises(StreamRaceError, match="read after write"):
        with Sanitizer(raise_on_race=True) as san:
            a = torch.empty(4)
            san._access(EP_COMM, "side_write", (), (a,))
            a.sum()


def _racy_offload(ctx):
    from overlap.state import STATE

    _offload(torch.randn(8, 4), wait=False)
    return [r.kind for r in STATE.sanitizer.races] if STATE.sanitizer is not None else None


def test_env_switch_reaches_spawned_ranks():
    (kinds,) = run_ranks(_racy_offload, 1, env={"OVERLAP_SANITIZE": "warn"})
    assert kinds and set(kinds) == {"read after write"}
    assert run_ranks(_racy_offload, 1) == [None]  # off unless asked for


def test_disjoint_parts_of_one_buffer_from_two_streams_are_not_a_race():
    buf = torch.empty(8, 4)
    with Sanitizer(raise_on_race=True) as san:
        san._access(EP_COMM, "side_fills_tail", (), (buf[4:],))
        buf[:4].fill_(1.0)  # main stream, the other half: no edge needed
        assert not san.races
        with pytest.raises(StreamRaceError, match="write after write"):
            buf[3:5].fill_(2.0)  # touches the side stream's rows without waiting for it


def _copy_in_on_side_stream(dst: torch.Tensor, src: torch.Tensor) -> None:
    with overlap.stream(KV_OFFLOAD):
        overlap.copy_(dst, src)  # the write


def _read_on_main(t: torch.Tensor) -> torch.Tensor:
    return t.sum()  # the read


def _fill_on_side_stream(t: torch.Tensor) -> None:
    with overlap.stream(SHARED_EXPERT):
        t.mul_(2)  # the first write


def _fill_on_main(t: torch.Tensor) -> None:
    t.add_(1)  # the second write


def _frames(access, name):
    return [f for f in access.stack if f.name == name and os.path.samefile(f.filename, __file__)]


def test_a_race_names_the_python_stack_of_both_accesses():
    src, dst = torch.randn(6), torch.empty(6)
    with pytest.raises(StreamRaceError, match=r"^stream race \(read after write\)") as err:
        with Sanitizer():
            _copy_in_on_side_stream(dst, src)  # a span's access: seen through the hooks
            _read_on_main(dst)  # a dispatched op's access: seen through the dispatch mode
    race, text = err.value.race, str(err.value)
    assert _frames(race.previous, "_copy_in_on_side_stream") and not _frames(race.previous, "_read_on_main")
    assert _frames(race.current, "_read_on_main") and not _frames(race.current, "_copy_in_on_side_stream")
    assert race.current.stack[-1].name == "_read_on_main"  # innermost last, torch's own frames left out
    assert _frames(race.current, "test_a_race_names_the_python_stack_of_both_accesses")
    # both stacks are printed, the first access's before the second's, with their source lines
    assert os.path.basename(__file__) in text
    first, second = text.index("overlap.copy_(dst, src)  # the write"), text.index("return t.sum()  # the read")
    assert text.index("_copy_in_on_side_stream") < first < text.index("_read_on_main") < second
    assert f"write by 'copy' on stream {KV_OFFLOAD!r} at:" in text
    assert f"read by 'aten.sum' on stream {DEFAULT!r} at:" in text


def test_both_stacks_of_a_race_between_dispatched_ops():
    from overlap.observability import sanitizer

    t = torch.zeros(4)
    with Sanitizer(raise_on_race=False, log_races=False) as san:
        _fill_on_side_stream(t)
        _fill_on_main(t)
    (race,) = san.races
    assert race.kind == "write after write"
    assert race.previous.stack[-1].name == "_fill_on_side_stream"
    assert race.current.stack[-1].name == "_fill_on_main"
    report = san.report()
    assert report.splitlines()[0] == str(race).splitlines()[0]
    for line in ("t.mul_(2)  # the first write", "t.add_(1)  # the second write", "_fill_on_side_stream",
                 "_fill_on_main"):
        assert line in report
    for access in (race.previous, race.current):
        assert 0 < len(access.stack) <= 5
        own = {os.path.abspath(sanitizer.__file__), os.path.abspath(overlap.hooks.__file__)}
        assert not [f for f in access.stack if os.path.abspath(f.filename) in own
                    or os.path.abspath(f.filename).startswith(os.path.dirname(torch.__file__) + os.sep)]
