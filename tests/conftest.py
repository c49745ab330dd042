import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads_per_worker() -> int:
    """This pytest-xdist worker's share of the cores: its torch and the processes its tests start use no more, or
    the workers' OpenMP threads spin for each other's cores (on 2 cores and 2 workers a single-process example took
    twice the CPU with 2 threads than with 1)."""
    return max(1, _cores() // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under -p no:xdist (the torchrun-mode runs)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores. A third of the suite's time is waiting, not computing (ranks
    starting, a peer's timeout, a hang found by its bound): on 2 cores 2 workers used 67% of the CPU and took
    8:40, 3 workers 6:18. ``$PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N`` still decide where given."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own reading of it
    return _cores() + 1


if "PYTEST_XDIST_WORKER" in os.environ:  # before torch is imported; a value the user set is kept
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker()))

_USER_PATH = os.environ.get("OVERLAP_PATH")  # read before any test changes it (`suite_path`)

# What the rank bodies of the multi-rank tests import, imported once by each worker's forkserver instead of in
# every rank it forks (transformers' modeling code alone is about 2 s of CPU a process); empty turns it off
os.environ.setdefault("OVERLAP_FORKSERVER_PRELOAD", ",".join([
    "pytest", "microbatch", "collectives", "launch.engine", "launch.measure", "launch.models", "transformers",
    "transformers.modeling_utils",
    "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_moe.modeling_qwen2_moe"]))


def suite_path():
    """The path every test starts on: $OVERLAP_PATH as the user set it; else, under torchrun, detection (the suite
    runs on the ranks and cards torchrun made); else the CPU path (its spawned ranks join over gloo), also on a
    machine with a GPU or an NPU, where detection would pick the device and two spawned ranks would share its card."""
    from overlap.multirank import under_torchrun

    return _USER_PATH or (None if under_torchrun() else "cpu")


@pytest.fixture(autouse=True)
def _clean_overlap_state(monkeypatch, tmp_path_factory):
    """Each test starts from a fresh toolkit state: the suite's path (`suite_path`), overlap on, no streams, events
    or limits, and an empty calibration cache of its own (what it calibrates is measured, and stays out of
    ~/.cache)."""
    import overlap

    monkeypatch.setenv("OVERLAP_CALIBRATION_CACHE", str(tmp_path_factory.mktemp("calibration")))

    for var in (overlap.ENV_PATH, overlap.ENV_ENABLE, "OVERLAP_CORE_BUDGET", "OVERLAP_CPU_LINK"):
        monkeypatch.delenv(var, raising=False)
    path = suite_path()
    if path:
        monkeypatch.setenv(overlap.ENV_PATH, path)
    from overlap.state import STATE

    overlap.reset()
    observers = list(STATE.observers)
    yield
    overlap.reset()
    overlap.set_peer_watch(False)  # a watch one test's generate started stops: under torchrun every test shares
    overlap.set_peer_watch(True)   # the process, and its step counts would carry into the next test's diagnoses
    leaked = [o for o in STATE.observers if o not in observers]
    if leaked:  # under torchrun every test shares the process: a leaked observer would change the next ones
        for o in leaked:
            getattr(o, "__exit__", lambda *a: None)(None, None, None)
        STATE.observers = observers
        pytest.fail(f"the test left observers installed: {leaked}")


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists: torchrun mode quiets it on ranks > 0
def pytest_configure(config):
    import signal

    import overlap
    from overlap.multirank import default_timeout, under_torchrun

    # A suite started in the background by a script (bash ignores SIGINT in its asynchronous commands) would pass
    # the ignored Ctrl-C on to every launcher it starts, and the tests that interrupt one would wait on it in vain.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        default_timeout()  # a bad OVERLAP_RANK_TIMEOUT: one line naming it, not a failure in every multi-rank test
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    overlap.sanitize_from_env()  # OVERLAP_SANITIZE=1|raise checks every test's stream ordering
    config.addinivalue_line("markers", "cpu_only: checks the CPU path (its engine model or CPU tensors); "
                                       "skipped where the tests run on NPU / CUDA ranks")
    config.addinivalue_line("markers", "spawns_ranks: starts its own processes; skipped under torchrun")
    if under_torchrun():
        from support.torchrun_mode import TorchrunMode

        config.pluginmanager.register(TorchrunMode(config), "overlap-torchrun-mode")


# The files whose tests start processes or compile graphs, slowest first: they go to the front, so that
# pytest-xdist's workers finish together instead of one running a 30 s test while the other idles.
_SLOW_FIRST = ("test_graph_prefill.py", "test_graph_decode.py", "test_launcher_graph.py", "test_torchrun_mode.py",
               "test_transformers_models.py", "test_wrap.py", "test_prefill_cli.py", "test_launcher_faults.py",
               "test_launcher_models.py", "test_multirank.py", "test_planner.py", "test_examples.py",
               "test_generate_cli.py", "test_decode.py", "test_decode_transformers.py")


def pytest_collection_modifyitems(config, items):
    """Slow files first (`_SLOW_FIRST`; the order inside a file is kept); under torchrun on devices, run the
    tests that exercise the devices' collectives and skip the rest."""
    import overlap
    from overlap.multirank import under_torchrun

    rank = {name: i for i, name in enumerate(_SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

    on_cpu = overlap.current_path() == "cpu"
    torchrun = under_torchrun()
    for item in items:
        if not on_cpu and "cpu_only" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"CPU-path test; this run is on {overlap.current_path()}"))
        if torchrun and "spawns_ranks" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="starts its own ranks; not under torchrun"))
