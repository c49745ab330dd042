"""Freed host memory kept for reuse on the CPU path (`overlap.host_memory`), and who asks for it."""
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import overlap
from overlap import host_memory


class _FakeLibc:
    def __init__(self, accepts=True):
        self.calls, self.accepts = [], accepts

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return 1 if self.accepts else 0


@pytest.fixture
def fake_libc(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    monkeypatch.setattr(host_memory, "_kept", None)
    monkeypatch.delenv(host_memory.ENV_KEEP_MEMORY, raising=False)
    return libc


def test_it_raises_the_mmap_threshold_to_its_ceiling_and_the_trim_threshold_once(fake_libc):
    said = overlap.keep_freed_memory()
    assert fake_libc.calls == [(-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert overlap.keep_freed_memory() == said and "kept" in said
    assert len(fake_libc.calls) == 2  # once a process


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_leaves_glibc_alone(fake_libc, monkeypatch, value):
    monkeypatch.setenv(host_memory.ENV_KEEP_MEMORY, value)
    assert "defaults" in overlap.keep_freed_memory()
    assert fake_libc.calls == []


def test_a_bad_switch_is_a_value_error_naming_it(fake_libc, monkeypatch):
    monkeypatch.setenv(host_memory.ENV_KEEP_MEMORY, "maybe")
    with pytest.raises(ValueError, match=r"\$OVERLAP_CPU_KEEP_MEMORY='maybe': expected 1, true, on, yes"):
        overlap.keep_freed_memory()
    assert fake_libc.calls == []


def test_without_glibc_or_where_glibc_refuses_it_says_so(fake_libc, monkeypatch):
    fake_libc.accepts = False
    assert "refused" in overlap.keep_freed_memory()
    monkeypatch.setattr(host_memory, "_kept", None)
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert "not glibc" in overlap.keep_freed_memory()


_STEPS = textwrap.dedent("""
    import resource, torch, overlap
    said = overlap.keep_freed_memory()
    def step():
        live = [torch.ones(1 << 19) for _ in range(12)]  # 12 x 2 MiB alive at once, as a step's intermediates
        del live
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(said, "|", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


@pytest.mark.skipif(host_memory._glibc() is None, reason="needs glibc")
def test_a_step_of_large_tensors_faults_in_no_page_once_memory_is_kept():
    """A fresh process: 12 tensors of 2 MiB alive at once, freed, 20 times. With glibc's defaults the freed heap top
    (24 MiB, over twice the largest block) is given back and faulted in again at every step, often (about 6000 minor
    faults a step where it happens); kept, none."""
    out = subprocess.run([sys.executable, "-c", _STEPS], capture_output=True, text=True, timeout=120, check=True)
    said, faults = out.stdout.strip().rsplit("|", 1)
    assert "kept" in said and float(faults) < 50, out.stdout


def test_the_calibrations_on_the_cpu_path_keep_freed_memory(monkeypatch):
    """Both calibrations run every size in turn: on the CPU path they keep freed memory first (without it the decode
    calibration's serial step of 256 tokens measured 76-78 ms where generation's took 46-51 ms)."""
    from launch.engine import calibrate_decode
    from launch.models import build_model, preset

    asked = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: asked.append(1) or "kept")
    model = build_model(dataclasses.replace(preset("tiny"), n_layers=2, n_dense_layers=1), seed=2)
    with torch.no_grad():
        calibrate_decode(model, max_tokens=1, histories=(2, 3), modes=("serial",), repeats=1, steps=1, refresh=True,
                         cache=None)
    assert asked == [1]


class _Stop(Exception):
    pass


def test_the_prefill_calibration_keeps_freed_memory_before_it_measures(monkeypatch):
    import microbatch.planning.prefill.measure as measure_mod
    from launch.models import build_model, preset
    from microbatch.planning import calibrate

    order = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: order.append("keep") or "kept")

    def measure(*args, **kwargs):
        order.append("measure")
        raise _Stop

    monkeypatch.setattr(measure_mod, "measure_costs", measure)
    with pytest.raises(_Stop):
        calibrate(build_model(preset("tiny"), seed=1), max_tokens=8, points=1, repeats=1, seq_len=4, refresh=True)
    assert order == ["keep", "measure"]


@pytest.mark.skipif(host_memory._glibc() is None, reason="needs glibc")
def test_a_calibrations_cache_key_holds_the_setting(monkeypatch):
    """A calibration measured with glibc's defaults (the page faults above) is not read back for one with freed memory
    kept, nor the other way round."""
    from launch.models import build_model, preset
    from microbatch.planning import calibration_key

    model = build_model(preset("tiny"), seed=1)
    monkeypatch.delenv(host_memory.ENV_KEEP_MEMORY, raising=False)
    kept = calibration_key(model)
    monkeypatch.setenv(host_memory.ENV_KEEP_MEMORY, "0")
    default = calibration_key(model)
    assert (kept["host_memory"], default["host_memory"]) == ("kept", "default")
