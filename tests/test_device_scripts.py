"""The device smoke scripts (`.ci/device-smoke`, `.ci/npu-smoke`) run only where a GPU or an Ascend node is lent,
so CI never runs them: here every launcher command in them is parsed by the launcher's own options, so an option
renamed or a value a choice no longer takes fails here, not on the device."""
import os
import re
import shlex

import click
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the scripts' shell values, as they are when the commands run
VALUES = {'"$(experts 8)"': "8", '"$fp8"': "fp8-checkpoint", '"$(experts 16)"': "16", '"$path"': "ge", '"$exchange"': "mc2", '"$n"': "2"}


def _commands(script: str):
    """``(launcher, args)`` of every ``torchrun ... launch/prefill.py`` / ``launch/generate.py`` command of
    ``script``, its continuation lines joined, up to its redirection."""
    text = open(os.path.join(ROOT, script)).read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        # npu-smoke's profiled run: a script that passes its arguments after the profile folder to prefill's main
        m = re.match(r'(?:\s*step \w+ \d+)?\s*torchrun .*?(launch/(?:prefill|generate)\.py|"\$out/npu_profile\.py" "\$out/[^"]*")(.*)',
                     line)
        if m is None:
            continue
        args = re.split(r"\s(?:2>&1|\||>)", m.group(2))[0]
        for shell, value in VALUES.items():
            args = args.replace(shell, value)
        args = re.sub(r'"\$(?:out|art)[^"]*"', "out", args)
        out.append((m.group(1) if m.group(1).startswith("launch/") else "launch/prefill.py", shlex.split(args)))
    return out


def _cli(launcher: str) -> click.Command:
    if launcher.endswith("generate.py"):
        from launch.generate import cli
    else:
        from launch.prefill import cli
    return cli


@pytest.mark.parametrize("script, at_least", [(".ci/device-smoke", 5), (".ci/npu-smoke", 6)])
def test_every_launcher_command_of_the_device_scripts_parses(script, at_least):
    commands = _commands(script)
    assert len(commands) >= at_least, commands  # the scripts still hold their launcher commands
    for launcher, args in commands:
        assert not [a for a in args if "$" in a], (launcher, args)  # every shell value stood in for
        _cli(launcher).make_context(launcher, list(args))  # click.UsageError / BadParameter name the option
    assert any("--decode-exchange" in args for _, args in commands) == (script == ".ci/npu-smoke")


@pytest.mark.spawns_ranks  # the script makes its own process group
@pytest.mark.timeout(180)
def test_the_smokes_profiled_prefills_give_overlap_report_its_points(tmp_path):
    """.ci/profile_points.py (device-smoke's torch.profiler traces of a shared and a two-batch prefill), run on CPU at
    the tiny size, writes the traces that the smoke's `overlap-report --points --point ...` commands read: one row
    per layer for each named point."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from overlap.observability.report import main

    env = dict(os.environ, MASTER_PORT=str(29700 + os.getpid() % 200), OVERLAP_PATH="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "profile_points.py"), str(tmp_path), "cpu",
                           "tiny"], capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = open(os.path.join(ROOT, ".ci", "device-smoke")).read().replace("\\\n", "")
    specs = re.findall(r"--point (\w+) '([^']+)' '([^']+)'", text)
    assert [name for name, _, _ in specs] == ["shared_experts", "exchange_beside_attention"], specs
    for (name, side, dominator), mode in zip(specs, ("shared", "two-batch")):
        got = CliRunner().invoke(main, [str(tmp_path / f"profile_{mode}.json"), "--points", "--point", name, side,
                                        dominator])
        assert got.exit_code == 0, got.output
        rows = [line for line in got.output.splitlines() if line.strip().startswith(f"point {name} side")]
        assert len(rows) >= 2, got.output  # the tiny preset's MoE layers
