"""Execution-path selection and the global enable switch."""
import pytest

import overlap


def test_auto_detects_cpu_here():
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
