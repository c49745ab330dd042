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
VALUES = {'"$(experts 8)"': "8", '"$(experts 16)"': "16", '"$path"': "ge", '"$exchange"': "mc2", '"$n"': "2"}


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
