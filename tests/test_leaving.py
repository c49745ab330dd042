"""How a rank of a multi-rank program leaves (`overlap.exit_rank`, `overlap.leave_group`; docs/reliability.md,
"Leaving"): what the documentation's two-rank examples do, run several times, every rank's exit clean."""
from __future__ import annotations

import os
import sys
import textwrap
from typing import List, Tuple

import pytest

from support import zygote
from support.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABORT = "terminate called without an active exception"
RUNS = 4  # a 1-in-3 abort (docs/decode.md's examples before exit_rank) passes 4 runs in a row 1 time in 5
# what the examples do: an expert-parallel model holds the group, generates over it, and the rank leaves
PROGRAM = textwrap.dedent("""\
    import atexit
    import torch.distributed as dist

    import overlap
    from launch.engine import generate, make_expert_parallel
    from launch.models import build_model, preset

    dist.init_process_group("gloo")
    atexit.register(print, "atexit ran", flush=True)
    model = make_expert_parallel(build_model(preset("tiny"), seed=0), dist.group.WORLD)
    out = generate(model, [[1, 2, 3], [4, 5, 6, 7]], 4, mode="two-batch", prefill_mode="two-batch")
    print(f"rank {dist.get_rank()}: {out.tokens}", flush=True)
    {ending}
    print("after the end", flush=True)
    """)

pytestmark = [pytest.mark.spawns_ranks, pytest.mark.timeout(300)]


def run_program(code: str, folder: str, ranks: int = 2, timeout: float = 120) -> List[Tuple[int, str, str]]:
    """``code`` as ``ranks`` processes of one gloo job (torchrun's variables, no torchrun): each rank's exit
    status, stdout and stderr."""
    path = os.path.join(folder, "program.py")
    with open(path, "w") as f:
        f.write(code)
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(ranks), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks),
                   OMP_NUM_THREADS="1")
        procs.append(zygote.Popen([sys.executable, path], env=env, cwd=folder))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except Exception:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def test_a_generating_two_rank_program_that_ends_with_exit_rank_leaves_cleanly_every_time(tmp_path):
    """Each of `RUNS` runs: every rank exits 0 after its output and its atexit handlers, with no abort, and nothing
    after ``exit_rank()`` runs. The same program ending with ``dist.destroy_process_group()`` aborted in the
    interpreter's teardown (docs/reliability.md, "Leaving", gives the counts)."""
    code = PROGRAM.replace("{ending}", "overlap.exit_rank()")
    for run in range(RUNS):
        outs = run_program(code, str(tmp_path))
        text = "".join(o + e for _, o, e in outs)
        assert [c for c, _, _ in outs] == [0, 0] and ABORT not in text, f"run {run + 1}: {text[-3000:]}"
        for rank, (_, out, _) in enumerate(outs):
            assert f"rank {rank}: [[" in out and "atexit ran" in out and "after the end" not in out, out


def test_exit_rank_with_a_failure_leaves_at_once_with_its_status(tmp_path):
    """A status other than 0 does not wait for the other ranks (they may be gone): rank 1 exits 3 while rank 0
    never comes to leave."""
    code = textwrap.dedent("""\
        import time
        import torch.distributed as dist
        import overlap

        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            overlap.exit_rank(3)
        time.sleep(1)
        overlap.exit_rank()
        """)
    outs = run_program(code, str(tmp_path), timeout=60)
    assert outs[1][0] == 3, outs[1]


@pytest.mark.parametrize("call, words", [
    ("overlap.exit_rank(256)", "exit_rank(status): an exit status from 0 to 255, got 256"),
    ("overlap.exit_rank(True)", "exit_rank(status): an exit status from 0 to 255, got True"),
    ("overlap.leave_group(timeout=0)", "leave_group(timeout): a number of seconds > 0"),
])
def test_a_bad_argument_is_a_one_line_value_error(call, words):
    import overlap  # noqa: F401  (the call names it)

    with pytest.raises(ValueError, match=r"^" + words.replace("(", r"\(").replace(")", r"\)")) as err:
        eval(call)
    assert "\n" not in str(err.value)
