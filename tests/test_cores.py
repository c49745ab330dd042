"""Core limits checked against the device's core budget."""
import pytest

import overlap
from overlap.cores import find_soc_config


def test_parse_budget():
    b = overlap.parse_budget("24|48")
    assert (b.aic, b.aiv) == (24, 48)
    b = overlap.parse_budget("24")
    assert (b.aic, b.aiv) == (24, 0)
    for bad in ("", "x|1", "0|4", "1|2|3", "24|-1"):
        with pytest.raises(overlap.CoreBudgetError, match="aic"):
            overlap.parse_budget(bad)


def test_soc_ini_is_read(tmp_path, monkeypatch):
    ini = tmp_path / "toolkit" / "x86_64-linux" / "data" / "platform_config" / "Ascend910_9391.ini"
    ini.parent.mkdir(parents=True)
    ini.write_text("[SoCInfo]\nai_core_cnt=24\ncube_core_cnt=24\nvector_core_cnt=48\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "toolkit"))
    monkeypatch.setenv("OVERLAP_SOC_VERSION", "Ascend910_9391")
    assert find_soc_config() == str(ini)
    budget = overlap.core_budget()
    assert (budget.aic, budget.aiv, budget.source) == (24, 48, str(ini))
    bad = tmp_path / "bad.ini"
    bad.write_text("[Other]\nx=1\n")
    with pytest.raises(overlap.CoreBudgetError, match="SoCInfo"):
        overlap.read_soc_config(str(bad))


def test_parallel_limits_within_budget_pass():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with overlap.stream("side"), overlap.limit_cores(8, 16):
        pass
    with overlap.limit_cores(16, 32):
        pass
    assert overlap.stream_limits() == {"side": (8, 16), overlap.DEFAULT: (16, 32)}


def test_oversubscription_is_a_clear_error_naming_streams(monkeypatch):
    monkeypatch.setenv("OVERLAP_CORE_BUDGET", "24|48")
    with overlap.stream("side"), overlap.limit_cores(8, 16):
        pass
    with pytest.raises(overlap.CoreBudgetError, match=r"28\|32.*24\|48.*side: 8\|16"):
        with overlap.limit_cores(20, 16):
            pass
    # the refused limit was not recorded
    assert overlap.stream_limits() == {"side": (8, 16)}


def test_single_limit_above_device_and_bad_values():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with pytest.raises(overlap.CoreBudgetError, match="more than the device"):
        with overlap.limit_cores(25, 1):
            pass
    with pytest.raises(overlap.CoreBudgetError, match="aic must be an int >= 1"):
        with overlap.limit_cores(0, 4):
            pass


def test_disabled_limits_are_not_recorded():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with overlap.enabled(False), overlap.limit_cores(24, 48), overlap.stream("s"), overlap.limit_cores(24, 48):
        pass
    assert overlap.stream_limits() == {}


def test_nested_npu_limits_restore_the_outer_limit(monkeypatch):
    """On the npu path an inner limit_cores puts the outer limit back on exit (fake torch.npu)."""
    import types

    import torch

    calls = []
    stream = object()
    fake = types.SimpleNamespace(current_stream=lambda: stream,
                                 set_stream_limit=lambda s, a, v: calls.append(("set", a, v)),
                                 reset_stream_limit=lambda s: calls.append(("reset",)))
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with overlap.use_path("npu"):
        with overlap.limit_cores(16, 32):
            with overlap.limit_cores(8, 16):
                pass
    assert calls == [("set", 16, 32), ("set", 8, 16), ("set", 16, 32), ("reset",)]


def test_main_stream_inside_a_side_scope_is_refused_on_graph_paths(monkeypatch):
    import contextlib
    import sys
    import types

    scope = types.SimpleNamespace(npu_stream_switch=lambda tag, prio=0: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "torchair", types.SimpleNamespace(scope=scope))
    monkeypatch.setitem(sys.modules, "torchair.scope", scope)
    with overlap.use_path("ge"):
        with overlap.stream(overlap.DEFAULT):  # at top level it is the main stream already
            pass
        with pytest.raises(ValueError, match="main stream cannot be entered inside"):
            with overlap.stream(overlap.EP_COMM), overlap.stream(overlap.DEFAULT):
                pass
