"""What the launcher writes under ``--out``: results.json, and per mode a Chrome trace and a PNG timeline.

The folder is checked before the run (`check_out_dir`), so an unwritable ``--out`` fails in a
second, not after the whole run; each file is written to a temporary name and renamed, so a full
disk never leaves a truncated ``results.json``, and a failure names the file (`OutputError`).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from overlap.observability import save_chrome_trace, save_png

if TYPE_CHECKING:
    from overlap import Span

    from .config import DecodeConfig, JobConfig
    from .measure.generate import RunResult
    from .measure.prefill import ModeResult


class OutputError(OSError):
    """A file under ``--out`` that could not be written; the message names it."""


def check_out_dir(out_dir: str) -> Optional[str]:
    """None when ``out_dir`` can be created and written to, else the problem in words."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as exc:
        return f"--out {out_dir} is not writable ({exc.strerror or exc})"
    return None


def check_kv_dir(folder: str, rank: int) -> Optional[str]:
    """None when ``folder`` can hold this rank's mmap KV store file (``kv-rank<rank>.kv``, created or replaced),
    else the problem in words: a folder that is a file, a store file that is not a regular file, no write access."""
    file = os.path.join(folder, f"kv-rank{rank}.kv")
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"the KV store folder {folder} is not a folder (--kv-store mmap keeps one file per rank in it)"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create the KV store folder {folder} ({exc.strerror or exc})"
    if os.path.lexists(file) and not os.path.isfile(file):
        return f"the KV store file {file} is not a regular file: remove it, or give another --out"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the KV store folder {folder} is not writable (Permission denied)"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as exc:
        return f"the KV store folder {folder} is not writable ({exc.strerror or exc})"
    return None


def _make_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` where it is missing; an `OutputError` naming it where it cannot be (a file put in its place
    during the run, say)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot write to --out {out_dir}: {exc.strerror or exc}"
                                     + (" (not a folder)" if os.path.exists(out_dir) else "")) from None


def _atomic(file: str, write: Callable[[str], object]) -> None:
    """``write(name)`` to a temporary name beside ``file`` (same extension), then rename it to ``file``."""
    folder, base = os.path.split(file)
    tmp = os.path.join(folder, f".partial-{base}")
    try:
        write(tmp)
        os.replace(tmp, file)
    except OSError as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise OutputError(exc.errno, f"cannot write {file}: {exc.strerror or exc}") from None


def write_outputs(out_dir: str, job: JobConfig, results: Sequence[ModeResult], tokens: int, world: int,
                  failed: List[str], say: Callable[[str], None], quantized: Optional[Dict[str, object]] = None) -> None:
    """Write ``out_dir``/results.json and each mode's ``trace_<mode>.json`` / ``timeline_<mode>.png``.

    ``job`` is the `launch.config.JobConfig`; ``failed`` the modes ``--check`` rejected; ``say``
    prints a line for the user; ``quantized``: a quantized checkpoint's format, bytes per rank and check.
    Raises `OutputError` naming the file that could not be written.
    """
    _make_out_dir(out_dir)

    def results_json(name: str) -> None:
        with open(name, "w") as f:
            json.dump({"world_size": world, "device": job.device, "dtype": str(job.dtype).replace("torch.", ""),
                       "seq_lens": list(job.seq_lens), "tokens": tokens, "model": job.model_name,
                       "config": job.model_fields(),
                       "kv_offload": job.kv_offload, "cpu_link": str(job.link) if job.link else None,
                       "cpu_comm_priority": job.comm_priority if job.device == "cpu" else None,
                       "dispatch": job.dispatch, "dispatch_dtype": job.dispatch_name,
                       "rows": [r.row(tokens) for r in results],
                       "serial_added": bool(getattr(job, "serial_added", False)),  # a row only as the reference
                       "check": None if not job.check else ("failed" if failed else "passed"),
                       "quantized": quantized}, f, indent=2)

    _atomic(os.path.join(out_dir, "results.json"), results_json)
    pngs = _traces(out_dir, [(r.mode, r.spans, f"{r.mode}: {world} rank(s), {tokens} tokens") for r in results], say)
    say(f"wrote {out_dir}/results.json, trace_<mode>.json" + (" and timeline_<mode>.png" if pngs else ""))


def _traces(out_dir: str, traces: Sequence[Tuple[str, Sequence[Span], str]], say: Callable[[str], None]) -> bool:
    """Each ``(name, spans, title)`` as ``trace_<name>.json`` and ``timeline_<name>.png``; whether PNGs were
    written (matplotlib is optional)."""
    pngs = True
    for name, spans, title in traces:
        _atomic(os.path.join(out_dir, f"trace_{name}.json"), lambda file, s=spans: save_chrome_trace(s, file))
        if pngs:
            try:
                _atomic(os.path.join(out_dir, f"timeline_{name}.png"),
                        lambda file, s=spans, t=title: save_png(s, file, title=t))
            except ImportError:
                pngs = False
                say("(matplotlib is not installed: no PNG timelines; pip install 'npu-overlap[plot]')")
    return pngs


def write_generation_outputs(out_dir: str, job: JobConfig, decode: DecodeConfig, results: Sequence[RunResult],
                             world: int, failed: List[str], say: Callable[[str], None],
                             quantized: Optional[Dict[str, object]] = None) -> None:
    """Write ``out_dir``/results.json of a generation and each mode's ``trace_<mode>.json`` /
    ``timeline_<mode>.png`` of one decode step (``prefill__decode`` where the modes differ); ``quantized`` as
    `write_outputs`'. Raises `OutputError` naming the file that could not be written."""
    _make_out_dir(out_dir)

    def results_json(name: str) -> None:
        with open(name, "w") as f:
            json.dump({"world_size": world, "device": job.device, "dtype": str(job.dtype).replace("torch.", ""),
                       "seq_lens": list(job.seq_lens), "model": job.model_name, "config": job.model_fields(),
                       "new_tokens": decode.new_tokens, "new_tokens_spread": decode.spread,
                       "stop_token": decode.stop_token, "kv_offload": job.kv_offload,
                       "cpu_link": str(job.link) if job.link else None, "dispatch": job.dispatch,
                       "dispatch_dtype": job.dispatch_name, "decode_exchange": decode.exchange,
                       "rows": [r.row() for r in results],
                       "check": None if not job.check else ("failed" if failed else "passed"),
                       "failures": failed, "quantized": quantized}, f, indent=2)

    _atomic(os.path.join(out_dir, "results.json"), results_json)
    traced = [(r.run.file_label, r.spans, f"{r.run.label}: one decode step, {world} rank(s)") for r in results
              if r.spans]
    pngs = _traces(out_dir, traced, say)
    if not traced:  # a timed round records its second decode step and every fourth after it
        say(f"wrote {out_dir}/results.json (no trace: a generation of one decode step records none; "
            f"--new-tokens 3 or more)")
        return
    say(f"wrote {out_dir}/results.json, trace_<mode>.json" + (" and timeline_<mode>.png" if pngs else "")
        + " (one decode step each)")
