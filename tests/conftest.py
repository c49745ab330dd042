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
