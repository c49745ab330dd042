"""Every command a user runs (the launchers, the benchmarks, overlap-report): ``-h`` as well as ``--help``, the options
the README says each launcher takes, and the defaults a benchmark shares with the launchers."""
import glob
import importlib
import os
import re

import click
import pytest
from click.testing import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "launch", "bench", "*.py"))
                    if not os.path.basename(p).startswith("_"))


def _commands():
    """(name, click command) of every command: the console scripts of pyproject.toml and every benchmark's."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:  # no tomllib before Python 3.11
        table = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', table, re.M))
    found = []
    for name, target in sorted(scripts.items()):
        module, function = target.split(":")
        mod = importlib.import_module(module)
        found.append((name, mod.cli if function == "script" else getattr(mod, function)))  # a launcher's: its cli
    for name in BENCHMARKS:
        command = getattr(importlib.import_module(f"launch.bench.{name}"), "main", None)
        if isinstance(command, click.Command):
            found.append((f"python -m launch.bench.{name}", command))
    return found


COMMANDS = _commands()


def test_every_command_is_found():
    names = {name for name, _ in COMMANDS}
    assert {"overlap-prefill", "overlap-generate", "overlap-report", "python -m launch.bench.pipeline",
            "python -m launch.bench.comm_threads", "python -m launch.bench.decode"} <= names, names


@pytest.mark.parametrize("name, command", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_command_takes_h_and_help(name, command):
    """``-h`` is ``--help`` everywhere (the benchmarks took ``--help`` alone, and said ``No such option: -h``)."""
    short, long = (CliRunner().invoke(command, [flag], prog_name=name) for flag in ("-h", "--help"))
    assert short.exit_code == 0 and long.exit_code == 0, short.output
    assert short.output == long.output and short.output.startswith(f"Usage: {name} "), short.output


def test_the_comm_threads_benchmark_runs_the_launchers_setting_unless_asked(monkeypatch):
    """`python -m launch.bench.comm_threads` runs gloo's threads at the launchers' default (normal priority) unless
    ``--settings`` asks for real-time (it ran real-time first by default, where the process may: as root)."""
    import overlap.multirank
    from launch.bench import comm_threads
    from overlap.comm_threads import DEFAULT_MODE

    asked = []

    class _Started(Exception):
        pass

    def run_ranks(fn, world, *args, **kwargs):
        asked.append(args[-2])  # settings, then loads
        raise _Started

    monkeypatch.setattr(overlap.multirank, "run_ranks", run_ranks)
    for args in ([], ["--settings", "rt,off"]):
        result = CliRunner().invoke(comm_threads.main, args)
        assert isinstance(result.exception, _Started), result.output
    assert asked == [[DEFAULT_MODE], ["rt", "off"]] and DEFAULT_MODE == "off"
    assert comm_threads.report([{"said": {"off": "normal priority"}, "probe": {("none", "off"): [(0.0, 1e-3)]},
                                 "times": {("none", "off", "serial"): [0.01, 0.02]}}], ["serial"], ["off"],
                               ["none"]).startswith("communication threads: off = normal priority")


def _section(text, start, end):
    return text[text.index(start):text.index(end)]


def _named_options(text):
    """The options a README passage names: every ``--name`` in its code spans."""
    return {m for span in re.findall(r"`([^`]+)`", text) for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)}


def _options(command, primary=True):
    return {o for p in command.params if isinstance(p, click.Option)
            for o in (p.opts if primary else p.opts + p.secondary_opts) if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("name, start, end", [
    ("overlap-prefill", "| option | default | meaning |", "Invalid configurations"),
    ("overlap-generate", "Of `launch/prefill.py`'s options it takes",
     "```text\ngenerate:"),
])
def test_the_readme_names_exactly_the_options_each_launcher_takes(name, start, end):
    """The README's list and tables of each launcher's options name every option it takes and no other (generation
    took none of --path, --kv-store and --auto-split-margin while the README said it took prefill's options)."""
    command = dict(COMMANDS)[name]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        named = _named_options(_section(f.read(), start, end))
    assert not _options(command) - named, f"options the README leaves out: {sorted(_options(command) - named)}"
    assert not named - _options(command, primary=False), f"not options of {name}: {sorted(named - _options(command))}"
