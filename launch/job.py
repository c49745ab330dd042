"""The life of a launcher process, shared by `launch.prefill` and `launch.generate`.

A command's process starts (`script`, `main`: a bad option is printed once per node before any rank
joins a group; Ctrl-C and torchrun's SIGTERM end the run through its clean-up), joins the group
(`start`), runs its job under one error policy (`guarded`: a peer's failure, a bounded wait that ran
out, or a bug, each said in one line per rank; a bug's traceback once) and leaves with the job's status
without the interpreter's teardown. On the way it tells the user what it does: rank 0's lines (`say`),
its progress (`progress`), where auto's calibration came from (`CalibrationSource`) and whether its
prediction still holds (`calibration_note`).
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import click
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from launch.config import JobConfig
    from launch.health import Fault, Peers


def rank() -> int:
    """This process's rank, from torchrun's environment (0 without it)."""
    return int(os.environ.get("RANK", "0"))


def say(msg: str, err: bool = False) -> None:
    """Print on rank 0 only."""
    if rank() == 0:
        click.echo(msg, err=err)


_LOGGED = {"stage": None}  # the stage of the last progress line written to a log


def progress(msg: str, stage: Optional[str] = None) -> None:
    """Progress on rank 0, on stderr: on a terminal, a line rewritten in place at every call; in a log (not a
    terminal), ``msg`` as a line of its own where ``stage`` (a round, a calibration's round) differs from the last
    one logged, so that a long run is seen moving without a line a step; nothing where ``stage`` is None. An empty
    ``msg`` ends the progress (the terminal's line is cleared)."""
    if rank() != 0:
        return
    if sys.stderr.isatty():
        sys.stderr.write("\r" + msg.ljust(60) + ("\r" if not msg else ""))
        sys.stderr.flush()
    elif stage is not None and stage != _LOGGED["stage"]:
        click.echo(msg, err=True)
    if stage is not None or not msg:
        _LOGGED["stage"] = stage


def threads(job: JobConfig) -> str:
    """The compute threads this rank runs (`start` sets them), and where that number comes from, for a headline."""
    n = torch.get_num_threads()
    return f"{n} compute thread{'s' if n > 1 else ''} per rank ({job.threads_from})"


FAR = 0.2  # a calibration's prediction this far from the time measured (a share of it) is noted, beyond the spread


class CalibrationSource:
    """Where a launcher's calibration came from: the calibration's report line (read from the cache, its file and
    when it was measured; or measured in this run), said on rank 0 as it comes and kept (`cached`)."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        say(line)

    @property
    def cached(self) -> bool:
        """Whether the calibration was read from the cache (measured before this run)."""
        return any(": cached (" in line for line in self.lines)


def calibration_note(what: str, predicted_s: float, measured_s: float, spread: Optional[float],
                     source: CalibrationSource) -> Optional[str]:
    """A line where a cached calibration's prediction of ``what`` is more than `FAR` (and the rounds' ``spread``) off
    the time measured beside it, suggesting ``--refresh-calibration``; None otherwise (a calibration measured in
    this run says how close it comes in the table's lines)."""
    off = abs(predicted_s - measured_s) / measured_s
    if not source.cached or off <= max(FAR, spread or 0.0):
        return None
    within = f", more than the rounds' spread of {spread:.0%}" if spread is not None else ""
    return (f"{what}: the cached calibration predicted {predicted_s * 1e3:.1f} ms and this run measured "
            f"{measured_s * 1e3:.1f} ms ({off:.0%} apart{within}): the host may not be as it was when the calibration "
            f"was measured; --refresh-calibration measures it again")


def main(cli: click.Command, args: Optional[List[str]], prog_name: str) -> None:
    """Run ``cli``: a bad option or configuration is printed once per node, before any rank joins a
    group; Ctrl-C and torchrun's SIGTERM end the run through its clean-up (exit 130 / 143)."""
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored Ctrl-C stays ignored
        signal.signal(signal.SIGINT, _interrupted)
    try:
        cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.ClickException as exc:  # ConfigError and click's usage errors
        leaving()  # the other ranks fail too, and torchrun's SIGTERM must not cut the one report short
        if first_to_report_on_this_node():
            exc.show()
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo(f"rank {rank()}: interrupted", err=True)
        sys.exit(130)


def script(run: Callable[[], None]) -> None:
    """``run()`` (a `main`) as a process's whole life: once the job is done and its outputs written, the process
    leaves with the job's status through `overlap.exit_rank` (the atexit handlers run, then no interpreter's
    teardown, where gloo's threads can abort a run that succeeded: "terminate called without an active exception",
    SIGABRT, which torchrun then reports as a failed job)."""
    import overlap

    try:
        run()
        code: Union[int, str, None] = 0
    except SystemExit as exc:
        code = exc.code
    leaving()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    overlap.exit_rank(code & 0xFF)


def _terminated(signum: int, frame: Optional[FrameType]) -> None:
    """torchrun's SIGTERM: leave through the run's clean-up (SystemExit). Where the signal lands inside a ``__del__``
    (the garbage collector finalizing some library's object), Python would swallow that SystemExit, print it as an
    ignored exception with its traceback and run on: the process leaves at once instead, as SIGKILL would."""
    if _in_finalizer(frame):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
    raise SystemExit(128 + signum)


def _interrupted(signum: int, frame: Optional[FrameType]) -> None:
    """Ctrl-C: KeyboardInterrupt, through the run's clean-up. Where it lands inside a ``__del__``, Python would
    swallow it there and run on (a rank stuck at that moment stays stuck): it is delivered again a moment later."""
    if _in_finalizer(frame):
        again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    raise KeyboardInterrupt


def _in_finalizer(frame: Optional[FrameType]) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def leaving() -> None:
    """From here the process is on its way out with a status of its own: torchrun's SIGTERM (sent when
    another rank exits first) is let pass instead of raising inside an atexit handler or the error
    report, which printed a traceback and could lose the report. Ctrl-C still interrupts; torchrun
    follows with SIGKILL if the exit does not come."""
    signal.signal(signal.SIGTERM, _ignored)


def _ignored(signum: int, frame: Optional[FrameType]) -> None:
    pass


def first_to_report_on_this_node() -> bool:
    """True on the first rank of this node to ask: a configuration error is printed once, by whichever
    rank finds it first (there is no process group yet, and torchrun stops the other ranks as soon as
    one exits). The ranks of a node share their parent (torchrun's agent) and the job's port."""
    if "LOCAL_RANK" not in os.environ:
        return True
    folder = os.path.join(tempfile.gettempdir(), "overlap-config-errors")
    try:
        started = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19]  # the parent's start
    except (OSError, IndexError):
        started = "0"
    marker = os.path.join(folder, f"{os.getppid()}-{started}-{os.environ.get('MASTER_PORT', '')}")
    try:
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):  # markers of jobs long gone
            if time.time() - os.path.getmtime(os.path.join(folder, old)) > 3600:
                os.remove(os.path.join(folder, old))
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no writable temporary folder: rank 0 speaks
        return rank() == 0
    return True


def start(job: JobConfig) -> Optional[Tuple[torch.device, Optional[Fault], Peers]]:
    """Set the job's compute threads, path, link, priorities and wait bound, then join the group: this rank's
    device, the injected fault (tests) and its peers' health; None (said in one line) when the group cannot be
    joined."""
    import overlap
    from launch.health import BEFORE_JOINING, Fault, Peers, StartError, join_group
    from overlap.link import OFF

    torch.set_num_threads(job.threads)  # before the first operation (`launch.config.compute_threads`)
    overlap.set_path(job.device)
    overlap.set_link(job.link or OFF)  # --cpu-link off is off, whatever $OVERLAP_CPU_LINK says
    overlap.set_comm_priority(job.comm_priority)
    if job.device == "cpu":
        overlap.keep_freed_memory()  # the CPU stand-in for a device's caching allocator (overlap.host_memory)
    overlap.set_wait_timeout(job.timeout)  # every wait of the toolkit, as the collectives' own timeout
    overlap.sanitize_from_env()
    watch_launcher()
    fault = Fault.from_env()
    if fault is not None:
        fault.maybe_fail(rank(), BEFORE_JOINING)
    try:
        dev = join_group(job.timeout)
    except StartError as exc:
        click.echo(f"rank {rank()}: {exc}", err=True)
        return None
    peers = Peers()
    if peers.world > 1:
        peers.watch()
    return dev, fault, peers


LAUNCHER_POLL = 1.0  # seconds between two looks at this rank's launcher (`watch_launcher`)


def watch_launcher(poll: float = LAUNCHER_POLL) -> None:
    """Under torchrun, a daemon thread that looks every ``poll`` s whether the agent that started this rank is still
    its parent: once it is gone (killed), one line and the process leaves at once (status 1), whatever its main
    thread is doing (a collective, a long step in C). Nothing outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()
    threading.Thread(target=_leave_when_orphaned, args=(agent, poll), name="overlap-launcher-watch",
                     daemon=True).start()


def _leave_when_orphaned(agent: int, poll: float) -> None:
    while os.getppid() == agent:
        time.sleep(poll)
    try:
        sys.stderr.write(f"rank {rank()}: its launcher (torchrun agent, pid {agent}) is gone; leaving\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def error_line(exc: BaseException, limit: int = 600) -> str:
    """``exc`` as the one line a rank prints: ``Type: message``'s first line, clipped to ``limit`` characters; where
    that line is a header that ends in ``:`` (an agreement's ``the ranks cannot go on together:``), the lines after
    it joined to it with ``; `` (the first line alone said nothing)."""
    first, *rest = f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__]
    rest = [r.strip() for r in rest if r.strip()]
    line = f"{first} {'; '.join(rest)}" if first.endswith(":") and rest else first
    return line if len(line) <= limit else line[:limit - 3] + "..."


def guarded(peers: Peers, body: Callable[[], int]) -> int:
    """``body()``'s exit status, every way it can fail said in one line per rank: ranks that do not agree on the
    job (exit 2, said once), an output that cannot be written, a peer's failure or a bounded wait that ran out
    (exit 1), torchrun's SIGTERM after another rank's failure; a bug's traceback is printed once."""
    import overlap
    from launch.agreement import JobMismatch
    from launch.health import is_peer_failure
    from launch.outputs import OutputError

    r, world = dist.get_rank(), dist.get_world_size()
    try:
        return body()
    except JobMismatch as exc:  # every rank has the same message: the first to get here prints it
        if peers.first_to_report("job"):
            click.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except OutputError as exc:
        click.echo(f"rank {r}: {exc.strerror}", err=True)
        return 1
    except Exception as exc:
        msg = error_line(exc)
        peer_failure = world > 1 and is_peer_failure(exc)
        detail = peers.diagnose() if peer_failure else ""
        peers.failed(msg)
        click.echo(f"rank {r}: {msg}" + (f"\nrank {r}: {detail}" if detail else ""), err=True)
        if not (peer_failure or isinstance(exc, overlap.WaitTimeout) or getattr(exc, "expected", False)):
            if peers.first_to_report():  # a bug: show where it came from, once
                click.echo(f"rank {r}: unexpected error; traceback (please include it in a report):\n"
                           + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
                           err=True)
            else:
                click.echo(f"rank {r}: (another rank printed the traceback of the first unexpected error)",
                           err=True)
        return 1
    except SystemExit as exc:  # torchrun's SIGTERM, sent when another rank exited first: say why, if it said
        if world > 1 and exc.code == 128 + signal.SIGTERM:
            leaving()
            detail = peers.diagnose()
            if " failed: " in detail:
                click.echo(f"rank {r}: stopped by torchrun after another rank's failure: {detail}", err=True)
        raise


def finish() -> None:
    """Leave the group once every rank is done (`overlap.leave_group`): nothing in flight on a side stream (nor a
    gloo callback) when it goes, the wait for the other ranks bounded by the job's."""
    import overlap

    overlap.leave_group()
