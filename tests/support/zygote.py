"""Python processes for the tests, forked from an interpreter that has already imported torch.

Importing torch costs a new interpreter about 2 s of CPU, most of what a launcher test's process does: forking
these processes took the suite from 952 to 759 s of CPU (7:56 to 6:23 with ``pytest -n auto`` on 2 cores).
`Popen` and `run` mirror `subprocess`'s for ``[sys.executable, SCRIPT | -m MODULE | -c CODE, *args]``: each pytest
worker starts one server process (the "zygote") that imports torch and nothing of this repository, and forks it
per call. The child
then sets up what a fresh interpreter would (environment, working folder, ``sys.argv``, ``sys.path`` from the
given ``PYTHONPATH``, its own session, stdin from /dev/null) and runs the program as ``__main__``; it leaves like
one too (non-daemon threads joined, atexit handlers, the exit status of ``sys.exit``).

What differs from a fresh interpreter: torch was imported under the worker's environment (torch reads a few
variables at import, e.g. ``TORCH_LOGS``), so a test about imports or about such variables starts a real
process (`subprocess`). ``OVERLAP_TEST_ZYGOTE=0`` makes every call here a real process too. torchrun's workers
are always started fresh by torchrun itself.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ENV_SWITCH = "OVERLAP_TEST_ZYGOTE"
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where `support` is found
PIPE = subprocess.PIPE


def enabled() -> bool:
    """Whether calls here fork the zygote (default) instead of starting a new interpreter."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and sys.platform.startswith("linux")


# ---------------------------------------------------------------- the zygote's side


def _serve(fd: int, base_path: List[str]) -> None:
    """The zygote: import torch, then fork a child per request on the socket ``fd`` and report its exit."""
    __import__("torch")  # the point of the zygote

    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            ready = select.select([sock, wake_r], [], [])[0]
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return  # the pytest worker is gone
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _child(request, fds, sock, base_path)  # never returns
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
        while True:  # reap every child that has exited; report its status as Popen.returncode would be
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: Dict, fds: List[int], sock: socket.socket, base_path: List[str]) -> None:
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds + [null]:
            os.close(f)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        kind, target, args = request["kind"], request["target"], request["args"]
        first = {"script": os.path.dirname(os.path.abspath(target)), "module": os.getcwd(), "code": ""}[kind]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first] + extra + base_path
        sys.argv = {"script": [target], "module": [target], "code": ["-c"]}[kind] + args
    except BaseException:  # the set-up failed: say so on the child's stderr
        import traceback

        traceback.print_exc()
        _leave(1)
    _leave(_run_main(kind, target))


def _run_main(kind: str, target: str) -> int:
    import runpy
    import types

    try:
        if kind == "script":
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        return 0
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except KeyboardInterrupt:  # as a fresh interpreter: the traceback, then death by SIGINT
        import traceback

        traceback.print_exc()
        _finalize()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finalize() -> None:
    from overlap.leaving import exit_steps  # imported late: the zygote preloads torch alone

    exit_steps()


def _leave(code: int) -> None:
    try:
        _finalize()
    finally:
        os._exit(code)


# ---------------------------------------------------------------- the tests' side


class _Zygote:
    """This pytest worker's zygote: started on first use, gone with the worker (its socket closes)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        boot = ("import sys; base = sys.path[1:]; sys.path.insert(0, sys.argv[2]); "
                "from support.zygote import _serve; _serve(int(sys.argv[1]), base)")
        self.proc = subprocess.Popen([sys.executable, "-c", boot, str(theirs.fileno()), _HERE],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock = ours
        self.status: Dict[int, int] = {}
        self.started: Dict[int, int] = {}
        self.next_id = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, request: Dict, fds: Sequence[int]) -> int:
        self.next_id += 1
        request = dict(request, id=self.next_id)
        socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
        deadline = time.monotonic() + 60
        while self.next_id not in self.started:
            if not self._read(deadline - time.monotonic()):
                raise RuntimeError("the test zygote did not start a process within 60 s "
                                   f"({ENV_SWITCH}=0 starts real ones)")
        return self.started.pop(self.next_id)

    def returncode(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """``pid``'s exit status once known, waiting at most ``timeout`` seconds (None: no bound)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.status:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not self._read(left) and not self.alive():
                raise RuntimeError("the test zygote exited while a process it started ran")
        return self.status[pid]

    def _read(self, timeout: Optional[float]) -> bool:
        if timeout is not None and timeout <= 0:
            timeout = 0
        if not select.select([self.sock], [], [], timeout)[0]:
            return False
        msg = self.sock.recv(1 << 16)
        if not msg:
            raise RuntimeError("the test zygote exited")
        reply = json.loads(msg)
        if "id" in reply:
            self.started[reply["id"]] = reply["pid"]
        else:
            self.status[reply["pid"]] = reply["status"]
        return True


_ZYGOTE: Optional[_Zygote] = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def _parse(args: Sequence[str]) -> Optional[Tuple[str, str, List[str]]]:
    """(kind, target, argv rest) for the command lines served here; None for any other."""
    args = [str(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) > 2:
        return "module", args[2], args[3:]
    if args[1] == "-c" and len(args) > 2:
        return "code", args[2], args[3:]
    if not args[1].startswith("-"):
        return "script", os.path.abspath(args[1]), args[2:]
    return None


class Process:
    """A forked child with `subprocess.Popen`'s methods that the tests use; stdout and stderr are pipes (text)."""

    def __init__(self, args: Sequence[str], kind: str, target: str, rest: List[str], env: Dict[str, str],
                 cwd: str) -> None:
        self.args = list(args)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.pid = _zygote().start(dict(kind=kind, target=target, args=rest, env=env, cwd=cwd),
                                       [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = os.fdopen(out_r, "r", encoding="utf-8", errors="replace")
        self.stderr = os.fdopen(err_r, "r", encoding="utf-8", errors="replace")
        self.returncode: Optional[int] = None
        self._chunks: Dict[int, List[bytes]] = {out_r: [], err_r: []}
        self._open = {out_r, err_r}

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = _zygote().returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = _zygote().returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(list(self._open), [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    self._chunks[fd].append(data)
                else:
                    self._open.discard(fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out, err = (b"".join(self._chunks[f.fileno()]).decode("utf-8", "replace") for f in (self.stdout, self.stderr))
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        for f in (getattr(self, "stdout", None), getattr(self, "stderr", None)):
            if f is not None:
                try:
                    f.close()
                except Exception:
                    pass


def Popen(args: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
          start_new_session: bool = True):
    """`subprocess.Popen(args, stdout=PIPE, stderr=PIPE, text=True, ...)`, forked from the zygote where it
    serves ``args`` (else a real process). The child is always in its own session (``os.killpg(proc.pid, ...)``
    reaches what it starts)."""
    parsed = _parse(args) if enabled() else None
    if parsed is None:
        return subprocess.Popen(list(args), env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True,
                                start_new_session=start_new_session)
    return Process(args, *parsed, env=dict(os.environ if env is None else env), cwd=cwd or os.getcwd())


def run(args: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, ...)` through `Popen`; at ``timeout`` the child is
    killed and `subprocess.TimeoutExpired` raised, as subprocess does."""
    proc = Popen(args, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


__all__ = ["ENV_SWITCH", "PIPE", "Popen", "Process", "enabled", "run"]
