import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _clean_overlap_state(monkeypatch):
    """Each test starts on auto-detected path with overlap on and no core limits recorded."""
    import overlap

    for var in (overlap.ENV_PATH, overlap.ENV_ENABLE, "OVERLAP_CORE_BUDGET", "OVERLAP_CPU_LINK"):
        monkeypatch.delenv(var, raising=False)
    overlap.set_path(None)
    overlap.set_enabled(None)
    overlap.set_core_budget(None)
    overlap.reset_core_limits()
    overlap.set_link(None)
    overlap.streams._swap_stream_tag(overlap.MAIN)  # a failed graph trace can leave a side stream current
    yield
    overlap.set_core_budget(None)
    overlap.reset_core_limits()


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: checks the CPU path (its engine model or CPU tensors); "
                                       "skipped where the tests run on NPU / CUDA ranks")
    config.addinivalue_line("markers", "spawns_ranks: starts its own processes; skipped under torchrun")


def pytest_collection_modifyitems(config, items):
    """Under torchrun on devices, run the tests that exercise the devices' collectives and skip the rest."""
    import overlap
    from overlap.multirank import under_torchrun

    on_cpu = overlap.current_path() == "cpu"
    torchrun = under_torchrun()
    for item in items:
        if not on_cpu and "cpu_only" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"CPU-path test; this run is on {overlap.current_path()}"))
        if torchrun and "spawns_ranks" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="starts its own ranks; not under torchrun"))
