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
        with overlap.stream(overlap.COMM) as tag:
            assert tag == overlap.MAIN
            assert overlap.current_stream_tag() == overlap.MAIN
    with overlap.stream(overlap.COMM, enabled=False):
        assert overlap.current_stream_tag() == overlap.MAIN
    with overlap.stream(overlap.COMM):
        assert overlap.current_stream_tag() == overlap.COMM
        with overlap.stream(overlap.MAIN):
            assert overlap.current_stream_tag() == overlap.MAIN
    assert overlap.current_stream_tag() == overlap.MAIN


def test_one_stream_object_per_tag():
    a = overlap.get_stream("x")
    assert overlap.get_stream("x") is a
    assert overlap.get_stream("y") is not a
    assert overlap.event("e") is overlap.event("e")
