"""``launch/prefill.py`` (or ``launch/generate.py``) run as its users run it: one process, under torchrun, or ranks
started by hand."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from support import zygote
from support.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "launch", "prefill.py")
GENERATE = os.path.join(ROOT, "launch", "generate.py")
TINY = ["--preset", "tiny", "--warmup", "0", "--iters", "1"]


def run_launcher(args: Sequence[str], ranks: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 timeout: float = 180, script: str = SCRIPT) -> subprocess.CompletedProcess:
    """The launcher (``script``: `SCRIPT` or `GENERATE`) with ``args``: one process, or ``ranks`` under torchrun;
    no $OVERLAP_FAULT unless ``env`` sets it."""
    cmd = [sys.executable, script] if ranks is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-port", str(free_port()), script]
    full_env = dict(os.environ, PYTHONPATH=ROOT)
    full_env.pop("OVERLAP_FAULT", None)
    full_env.update(env or {})
    return zygote.run(cmd + list(args), timeout=timeout, env=full_env, cwd=ROOT)


def run_here(main: Callable[[List[str]], None], args: Sequence[str], capsys, monkeypatch) -> Tuple[int, str, str]:
    """A launcher's ``main(args)`` in this process, for what it refuses before any rank joins a group (a process of
    its own costs an interpreter with torch, ~4 s): (exit status, stdout, stderr). ``capsys`` and ``monkeypatch``:
    the test's fixtures; no torchrun variables reach it, and the SIGTERM handler it sets is put back."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    sigterm = signal.getsignal(signal.SIGTERM)  # main() sets its own; this process keeps pytest's
    try:
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def by_hand(per_rank_args: Sequence[Sequence[str]], env: Union[None, Dict[str, str], List[Dict[str, str]]] = None,
            timeout: float = 120, script: str = SCRIPT) -> List[Tuple[int, str, str]]:
    """Start one process per entry of ``per_rank_args`` as the ranks of one job (no torchrun) of ``script``
    (`SCRIPT` or `GENERATE`); their results (exit status, stdout, stderr) in rank order. ``env``: added to every
    rank's environment, or a list of one such dict per rank; no $OVERLAP_FAULT unless it sets one."""
    port = free_port()
    procs = []
    for rank, args in enumerate(per_rank_args):
        extra = env[rank] if isinstance(env, list) else env
        rank_env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        WORLD_SIZE=str(len(per_rank_args)), RANK=str(rank), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(len(per_rank_args)))
        rank_env.pop("OVERLAP_FAULT", None)
        rank_env.update(extra or {})
        procs.append(zygote.Popen([sys.executable, script] + list(args), env=rank_env, cwd=ROOT))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def all_text(outs: Sequence[Tuple[int, str, str]]) -> str:
    """Every rank's stdout and stderr of `by_hand`'s results, in rank order."""
    return "".join(o + e for _, o, e in outs)
