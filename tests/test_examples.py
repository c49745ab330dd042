"""Every ```python block of README.md and docs/*.md is a program, run as its user runs it.

Each block is written to ``example.py`` in a fresh folder and run with ``python example.py``, or,
when its first line says ``# torchrun --nproc-per-node N example.py``, under torchrun on N gloo
ranks; through tests/support/example_runner.py, which turns the stream sanitizer on
(``OVERLAP_SANITIZE=raise``: a missing event wait fails the example). A multi-rank example ends with
``overlap.exit_rank()``, which leaves without the interpreter's teardown, where gloo's threads can abort a rank
that succeeded (docs/reliability.md, "Leaving"); the runner fails one that returns instead, so no run is ever
repeated to get past such an abort. Blocks are found, not listed: a new example is run as soon as it is written,
and a fragment fails (there are none by design). An example that needs what may be missing (the torch_npu wheel of the graph-mode
harness) prints ``skipped: <reason>`` and exits 0, and the test skips with that reason.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import signal
import subprocess
import sys
import textwrap
from typing import List, Optional

import pytest

from support import zygote
from support.example_runner import NOT_LEFT
from support.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "support", "example_runner.py")
TIMEOUT_S = 150  # one example, start to exit (torchrun and a transformers import included)
_OPEN = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_TORCHRUN = re.compile(r"^#\s*torchrun\s+--nproc-per-node[ =](?P<n>\d+)\s+example\.py\b")
_SKIPPED = re.compile(r"^skipped: (?P<why>.+)$", re.MULTILINE)
_RAISED = re.compile(r"^(?:\[rank\d+\]: )?(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*$", re.MULTILINE)
spawns = pytest.mark.spawns_ranks  # starts its own processes (torchrun for multi-rank examples)


@dataclasses.dataclass(frozen=True)
class Example:
    """One ```python block: the file and line of its opening fence, and its code (dedented)."""

    file: str
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def ranks(self) -> Optional[int]:
        """N for a ``# torchrun --nproc-per-node N example.py`` first line, else None (``python example.py``)."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        m = _TORCHRUN.match(first)
        return int(m.group("n")) if m else None


def examples_in(text: str, file: str) -> List[Example]:
    """The ```python blocks of a markdown ``text`` (indented ones inside lists included)."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group("indent"), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{file}:{start + 1}: a ``` block that is never closed")
        if m.group("lang") == "python":
            body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start + 1:end]]
            out.append(Example(file, start + 1, textwrap.dedent("\n".join(body)) + "\n"))
        i = end + 1
    return out


def all_examples() -> List[Example]:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            out += examples_in(f.read(), os.path.relpath(path, ROOT))
    return out


def failure(proc: subprocess.CompletedProcess) -> str:
    """What went wrong: the exceptions raised (each rank's, before torchrun's own summary), then the tail."""
    raised = list(dict.fromkeys(m.group(0) for m in _RAISED.finditer(proc.stderr)))
    return "\n".join(raised[:4] + ["", proc.stderr[-3000:]])


def run_example(code: str, folder: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``code`` as ``folder/example.py``, run in ``folder`` as its first line says, the sanitizer raising.

    The process group (torchrun and its ranks) is killed at ``timeout``; a `pytest.fail` says so.
    """
    path = os.path.join(folder, "example.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    ranks = Example("", 0, code).ranks
    cmd = [sys.executable, RUNNER, path]
    if ranks is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                    str(free_port())]
    env = dict(os.environ, PYTHONPATH=ROOT, OVERLAP_SANITIZE="raise",
               OVERLAP_CALIBRATION_CACHE=os.path.join(folder, "calibration"))  # measured afresh, kept out of ~
    proc = zygote.Popen(cmd, cwd=folder, env=env)  # in a session of its own
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks too
        out, err = proc.communicate()
        pytest.fail(f"the example did not finish within {timeout:.0f} s:\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


EXAMPLES = all_examples()


@spawns
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example_runs_as_written(example, tmp_path):
    proc = run_example(example.code, str(tmp_path))
    assert proc.returncode == 0, f"{example.where} failed (exit {proc.returncode}):\n{failure(proc)}"
    skipped = _SKIPPED.search(proc.stdout)
    if skipped:
        pytest.skip(f"{example.where}: {skipped.group('why')}")


def test_examples_are_found_and_multi_rank_ones_own_their_group():
    assert len(EXAMPLES) >= 10 and {e.file for e in EXAMPLES} >= {"README.md", "docs/expert-parallel.md"}
    for e in EXAMPLES:
        if e.ranks is not None:  # it joins a group, and leaves it through the one call that ends a rank cleanly
            assert "init_process_group(" in e.code and "destroy_process_group" not in e.code, e.where
            assert e.code.rstrip().splitlines()[-1].startswith("overlap.exit_rank()"), e.where


def test_blocks_are_extracted_with_their_lines_and_indentation():
    text = "intro\n```bash\nls\n```\n- a list item:\n  ```python\n  import os\n  print(os.sep)\n  ```\n" \
           "```python\n# torchrun --nproc-per-node 2 example.py\nx = 1\n```\n"
    got = examples_in(text, "guide")
    assert [(e.line, e.code, e.ranks) for e in got] == [
        (6, "import os\nprint(os.sep)\n", None), (10, "# torchrun --nproc-per-node 2 example.py\nx = 1\n", 2)]
    with pytest.raises(ValueError, match="guide:1: a ``` block that is never closed"):
        examples_in("```python\nx = 1\n", "guide")


RACE = """import torch
import overlap

x = torch.ones(4) * 2                 # written on the main stream
with overlap.stream(overlap.EP_COMM):
    y = x + 1                         # read on ep_comm with no event wait: a race
"""


@spawns
@pytest.mark.parametrize("code, expected", [(RACE, "StreamRaceError: stream race (read after write)"),
                                            ("import torch\nprint(undefined_name)\n", "NameError")],
                         ids=["race", "fragment"])
def test_a_racy_or_incomplete_example_fails(code, expected, tmp_path):
    proc = run_example(code, str(tmp_path))
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-3000:]


@spawns
def test_an_example_that_hangs_is_stopped_and_named(tmp_path):
    # the example sleeps 600 s: any bound stops it; 1 s keeps this test's own time short
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        run_example("import time\ntime.sleep(600)\n", str(tmp_path), timeout=1)


@spawns
def test_a_multi_rank_example_that_returns_instead_of_leaving_fails(tmp_path):
    """Under torchrun (``LOCAL_RANK`` set) an example that returns to the runner fails, naming `overlap.exit_rank`:
    the teardown after it is where gloo's threads abort a rank that succeeded (before, such an abort was retried)."""
    path = tmp_path / "example.py"
    path.write_text("print('the example ran')\n")
    env = dict(os.environ, PYTHONPATH=ROOT, LOCAL_RANK="0")
    proc = zygote.run([sys.executable, RUNNER, str(path)], cwd=str(tmp_path), env=env, timeout=60)
    assert proc.returncode == 1 and "the example ran" in proc.stdout and NOT_LEFT in proc.stderr, proc.stderr
    env.pop("LOCAL_RANK")  # a single-process example returns as any program does
    assert zygote.run([sys.executable, RUNNER, str(path)], cwd=str(tmp_path), env=env, timeout=60).returncode == 0
