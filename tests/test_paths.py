"""Execution-path selection, the global enable switch, and the environment variables behind them."""
import pytest
import torch

import overlap


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_detects_cpu_here(monkeypatch):
    monkeypatch.delenv(overlap.ENV_PATH, raising=False)  # the suite's own (tests/conftest.py: suite_path)
    assert overlap.detect_path() == "cpu"
    assert overlap.current_path() == "cpu"


def test_env_override(monkeypatch):
    monkeypatch.setenv(overlap.ENV_PATH, "cuda")
    assert overlap.current_path() == "cuda"
    monkeypatch.setenv(overlap.ENV_PATH, "GE")
    assert overlap.current_path() == "ge"


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(overlap.ENV_PATH, "tpu")
    with pytest.raises(ValueError, match="OVERLAP_PATH.*expected one of"):
        overlap.current_path()


def test_argument_override_wins_over_env(monkeypatch):
    monkeypatch.setenv(overlap.ENV_PATH, "cuda")
    with overlap.use_path("aclgraph"):
        assert overlap.current_path() == "aclgraph"
    assert overlap.current_path() == "cuda"
    with pytest.raises(ValueError, match="unknown execution path"):
        overlap.set_path("gpu")


def test_enable_switch_env_and_context(monkeypatch):
    assert overlap.is_enabled()
    monkeypatch.setenv(overlap.ENV_ENABLE, "0")
    assert not overlap.is_enabled()
    with overlap.enabled(True):
        assert overlap.is_enabled()
    monkeypatch.setenv(overlap.ENV_ENABLE, "off")
    assert not overlap.is_enabled()
    monkeypatch.setenv(overlap.ENV_ENABLE, "1")
    with overlap.enabled(False):
        assert not overlap.is_enabled()


def test_pin_sets_the_path_and_the_switch_until_restored(monkeypatch):
    """`overlap.context.pin` (a program's run) sets both at once, over the environment and an enclosing block, and
    `restore` puts back exactly what was there; an unknown path is refused as `use_path` refuses it."""
    from overlap.context import pin

    monkeypatch.setenv(overlap.ENV_PATH, "cuda")
    monkeypatch.setenv(overlap.ENV_ENABLE, "0")
    with overlap.use_path("npu"):
        pinned = pin("cpu", True)
        assert overlap.current_path() == "cpu" and overlap.is_enabled()
        pinned.restore()
        assert overlap.current_path() == "npu" and not overlap.is_enabled()
    assert overlap.current_path() == "cuda"
    with pytest.raises(ValueError, match="unknown execution path 'gpu' from pin()"):
        pin("gpu", True)
    assert overlap.current_path() == "cuda" and not overlap.is_enabled()


def test_disabled_stream_is_the_current_stream():
    with overlap.enabled(False):
        with overlap.stream(overlap.EP_COMM) as tag:
            assert tag == overlap.DEFAULT
            assert overlap.current_stream_tag() == overlap.DEFAULT
    with overlap.stream(overlap.EP_COMM, enabled=False):
        assert overlap.current_stream_tag() == overlap.DEFAULT
    with overlap.stream(overlap.EP_COMM):
        assert overlap.current_stream_tag() == overlap.EP_COMM
        with overlap.stream(overlap.DEFAULT):
            assert overlap.current_stream_tag() == overlap.DEFAULT
    assert overlap.current_stream_tag() == overlap.DEFAULT


def test_one_stream_object_per_tag():
    a = overlap.get_stream("x")
    assert overlap.get_stream("x") is a
    assert overlap.get_stream("y") is not a
    assert overlap.event("e") is overlap.event("e")


@pytest.mark.parametrize("var, value, match", [
    ("OVERLAP_ENABLE", "maybe", r"\$OVERLAP_ENABLE='maybe': expected 1, true, on, yes .* or 0, false, off, no"),
    ("OVERLAP_ENABLE", "2", r"\$OVERLAP_ENABLE='2'"),
    ("OVERLAP_GRAPH_PATH", "bogus",
     r"unknown graph path 'bogus' from \$OVERLAP_GRAPH_PATH; expected one of ge, aclgraph"),
    ("OVERLAP_GRAPH_PATH", "cpu", r"unknown graph path 'cpu' from \$OVERLAP_GRAPH_PATH"),  # not a graph path
])
def test_a_bad_switch_or_graph_path_in_the_environment_is_a_value_error_naming_it(monkeypatch, var, value, match):
    """Before: ``maybe`` (anything but 0, false, off, no) was taken for on, and $OVERLAP_GRAPH_PATH was read
    only inside a compiled region on an NPU, so a typo went unnoticed everywhere else."""
    monkeypatch.delenv(overlap.ENV_PATH, raising=False)  # detection reads it (the suite sets a path: suite_path)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        overlap.is_enabled() if var == "OVERLAP_ENABLE" else overlap.current_path()


@pytest.mark.parametrize("value, on", [("", True), ("1", True), (" Yes ", True), ("TRUE", True), ("on", True),
                                       ("0", False), ("no", False), ("Off", False), ("false", False)])
def test_the_switch_takes_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv(overlap.ENV_ENABLE, value)
    assert overlap.is_enabled() is on


def test_a_link_set_off_stays_off_whatever_the_environment_says(monkeypatch):
    from overlap.link import OFF

    monkeypatch.setenv("OVERLAP_CPU_LINK", "2,20")
    assert overlap.current_link() == overlap.Link(2.0, 20.0)  # set_link(None): the environment's
    overlap.set_link(OFF)
    assert overlap.current_link() is None
    monkeypatch.setenv("OVERLAP_CPU_LINK", "abc")  # not even read
    assert overlap.current_link() is None
    overlap.set_link(None)
    with pytest.raises(ValueError, match="OVERLAP_CPU_LINK: expected 'GBPS"):
        overlap.current_link()
    monkeypatch.setenv("OVERLAP_CPU_LINK", "off")
    assert overlap.current_link() is None
    with pytest.raises(ValueError, match="set_link takes a Link, 'off' or None"):
        overlap.set_link("0.1")
