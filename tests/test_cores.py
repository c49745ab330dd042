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
    with overlap.limit_cores(16, 32):  # the main stream's share first
        with overlap.stream("side"), overlap.limit_cores(8, 16):
            pass
    assert overlap.stream_limits() == {"side": (8, 16), overlap.DEFAULT: (16, 32)}
    with overlap.stream("side"), overlap.limit_cores(4, 8):  # shares persist: a smaller limit fits
        pass
    assert overlap.stream_limits()["side"] == (8, 16)


@pytest.mark.parametrize("budget", [overlap.CoreBudget(24, 48), None])
def test_side_limit_while_the_main_stream_is_unlimited_is_refused(budget):
    """An unlimited stream takes the whole device: 8|16 beside an unlimited main stream oversubscribes it."""
    overlap.set_core_budget(budget)
    with pytest.raises(overlap.CoreBudgetError) as err:
        with overlap.stream(overlap.EP_COMM), overlap.limit_cores(8, 16):
            pass
    text = str(err.value)
    assert "default: unlimited (the whole device" in text and "ep_comm: 8|16" in text, text
    assert "Limit the main stream too" in text
    if budget is not None:
        assert "the whole device, 24|48" in text
    assert overlap.stream_limits() == {}  # the refused limit was not recorded


def test_oversubscription_is_a_clear_error_naming_every_stream_and_share(monkeypatch):
    monkeypatch.setenv("OVERLAP_CORE_BUDGET", "24|48")
    with overlap.limit_cores(16, 32), overlap.stream("side"), overlap.limit_cores(8, 16):
        pass
    with pytest.raises(overlap.CoreBudgetError,
                       match=r"add up to 28\|56 .*24\|48 from OVERLAP_CORE_BUDGET \(default: 16\|32; "
                             r"shared: 4\|8; side: 8\|16\)"):
        with overlap.stream("shared"), overlap.limit_cores(4, 8):
            pass
    with pytest.raises(overlap.CoreBudgetError, match=r"add up to 28\|48 .*\(default: 20\|32; side: 8\|16\)"):
        with overlap.limit_cores(20, 16):
            pass
    # the refused limits were not recorded
    assert overlap.stream_limits() == {"side": (8, 16), overlap.DEFAULT: (16, 32)}


def test_single_limit_above_device_and_bad_values():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with pytest.raises(overlap.CoreBudgetError, match="more than the device"):
        with overlap.limit_cores(25, 1):
            pass
    with pytest.raises(overlap.CoreBudgetError, match="aic must be an int >= 1"):
        with overlap.limit_cores(0, 4):
            pass
    assert overlap.stream_limits() == {}


@pytest.mark.parametrize("budget", [overlap.CoreBudget(24, 48), None])
def test_zero_vector_cores_is_refused_where_the_chip_has_them(budget):
    """torch_npu sends aiv=0 as a limit of 0 vector cores (only -1 leaves it): refuse it."""
    overlap.set_core_budget(budget)
    with pytest.raises(overlap.CoreBudgetError, match=r"limit_cores\(aic=8, aiv=0\): aiv must be an int >= 1.*got 0"):
        with overlap.limit_cores(8, 0):
            pass
    assert overlap.stream_limits() == {}


def test_a_chip_without_vector_cores_takes_aiv_zero_only():
    overlap.set_core_budget(overlap.parse_budget("24"))
    with overlap.limit_cores(16, 0), overlap.stream("side"), overlap.limit_cores(8, 0):
        pass
    assert overlap.stream_limits() == {overlap.DEFAULT: (16, 0), "side": (8, 0)}
    with pytest.raises(overlap.CoreBudgetError, match="no vector cores.*aiv must be 0, got 4"):
        with overlap.limit_cores(8, 4):
            pass


def test_disabled_limits_are_not_recorded():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with overlap.enabled(False), overlap.stream("s"), overlap.limit_cores(24, 48):
        pass
    assert overlap.stream_limits() == {}


class _FakeNpu:
    """torch.npu's stream limits as torch_npu has them: limits live on the device stream, and
    ``current_stream()`` returns a new Python object on every call. An unlimited part reads as 0."""

    class Stream:
        def __init__(self, stream_id):
            self.stream_id = stream_id

    def __init__(self):
        self.limits = {}  # stream id -> (cube, vector)
        self.current = 0

    def current_stream(self):
        return self.Stream(self.current)

    def get_stream_limit(self, stream):
        cube, vector = self.limits.get(stream.stream_id, (0, 0))
        return {"cube_core_num": cube, "vector_core_num": vector}

    def set_stream_limit(self, stream, cube_num=-1, vector_num=-1):
        cube, vector = self.limits.get(stream.stream_id, (0, 0))
        cube, vector = (cube if cube_num == -1 else cube_num), (vector if vector_num == -1 else vector_num)
        self.limits[stream.stream_id] = (cube, vector)

    def reset_stream_limit(self, stream):
        self.limits.pop(stream.stream_id, None)


@pytest.fixture
def fake_npu(monkeypatch):
    import torch

    npu = _FakeNpu()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    with overlap.use_path("npu"):
        yield npu


def test_nested_npu_limits_restore_the_outer_limit(fake_npu):
    """On the npu path an inner limit_cores puts the outer limit back on exit, and the last one clears it."""
    seen = []
    with overlap.limit_cores(16, 32):
        seen.append(fake_npu.limits[0])
        with overlap.limit_cores(8, 16):
            seen.append(fake_npu.limits[0])
        seen.append(fake_npu.limits[0])
    assert seen == [(16, 32), (8, 16), (16, 32)]
    assert 0 not in fake_npu.limits, "the stream was unlimited before: it is unlimited again"


def test_npu_limit_restores_a_limit_set_outside_the_toolkit(fake_npu):
    fake_npu.limits[0] = (20, 40)  # e.g. torch.npu.set_stream_limit called by the model
    with overlap.limit_cores(8, 16):
        assert fake_npu.limits[0] == (8, 16)
    assert fake_npu.limits[0] == (20, 40)
    fake_npu.limits[0] = (12, 0)  # only the cube cores were limited
    with overlap.limit_cores(8, 16):
        pass
    assert fake_npu.limits[0] == (12, 0)


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


@pytest.mark.parametrize("value, words", [
    ("abc", "such as '24|48', got 'abc'"), ("-1", "aic >= 1 and aiv >= 0, got '-1'"), ("24|48|1", "got '24|48|1'"),
    ("24|-8", "aiv >= 0, got '24|-8'"),
])
def test_a_bad_budget_in_the_environment_is_refused_naming_it(monkeypatch, value, words):
    """What the launcher checks before the run (before: accepted there, since it limits no stream)."""
    from overlap.cores import env_core_budget

    monkeypatch.setenv("OVERLAP_CORE_BUDGET", value)
    with pytest.raises(overlap.CoreBudgetError) as err:
        env_core_budget()
    assert str(err.value).startswith("OVERLAP_CORE_BUDGET: expected 'aic|aiv'") and words in str(err.value)
    with pytest.raises(ValueError, match="OVERLAP_CORE_BUDGET"):
        overlap.core_budget()
    monkeypatch.setenv("OVERLAP_CORE_BUDGET", " ")
    assert env_core_budget() is None
