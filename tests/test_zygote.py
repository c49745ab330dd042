"""tests/support/zygote.py: a process forked from the zygote behaves as a fresh interpreter would, as the tests
that start the launchers read it (exit status, output, argv, paths, environment, atexit, signals, timeouts): each
program is run both ways and compared."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from support import zygote

PROGRAM = textwrap.dedent("""
    import atexit, json, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps(dict(argv=sys.argv[1:], cwd=os.getcwd(), path0=sys.path[0], var=os.environ.get("ZYG_VAR"),
                          on_path=os.environ["ZYG_EXTRA"] in sys.path, name=__name__)),
          flush=True)
    how = sys.argv[1]
    if how == "exit3":
        sys.exit(3)
    if how == "message":
        sys.exit("a message")
    if how == "raise":
        raise ValueError("boom")
    if how == "none":
        sys.exit()
""")


def _both(args, **kw):
    """The same command as a real process and as a fork of the zygote: (real, forked) CompletedProcesses."""
    real = subprocess.run(args, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, **kw)
    forked = zygote.run(args, timeout=120, **kw)
    return real, forked


@pytest.mark.parametrize("how", ["exit3", "message", "raise", "none", "fall-off"])
def test_a_script_exits_prints_and_sees_what_a_fresh_interpreter_would(tmp_path, how):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    extra = str(tmp_path / "extra")
    env = dict(os.environ, ZYG_VAR="x", ZYG_EXTRA=extra, PYTHONPATH=extra)
    real, forked = _both([sys.executable, str(script), how, "more"], env=env, cwd=str(tmp_path))
    assert forked.returncode == real.returncode, (real, forked)
    assert forked.stdout == real.stdout, (real.stdout, forked.stdout)
    assert "atexit ran" in forked.stdout
    if how == "raise":
        assert forked.stderr.splitlines()[-1] == real.stderr.splitlines()[-1] == "ValueError: boom"
    else:
        assert forked.stderr == real.stderr, (real.stderr, forked.stderr)


def test_a_module_and_a_command_run_as_main(tmp_path):
    (tmp_path / "zyg_mod.py").write_text(PROGRAM)
    env = dict(os.environ, ZYG_VAR="m", ZYG_EXTRA=str(tmp_path), PYTHONPATH=str(tmp_path))
    for args in ([sys.executable, "-m", "zyg_mod", "exit3"], [sys.executable, "-c", PROGRAM, "exit3"]):
        real, forked = _both(args, env=env, cwd=str(tmp_path))
        assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout) == (3, real.stdout), (real, forked)


def test_a_timeout_raises_and_kills_and_a_signal_is_the_status(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    proc = zygote.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert proc.stdout.readline() == "up\n"
    os.killpg(proc.pid, signal.SIGTERM)  # its own session, as start_new_session=True
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_the_switch_starts_real_processes(monkeypatch):
    monkeypatch.setenv(zygote.ENV_SWITCH, "0")
    proc = zygote.Popen([sys.executable, "-c", "print('real')"])
    assert isinstance(proc, subprocess.Popen)
    assert proc.communicate(timeout=120)[0] == "real\n"
