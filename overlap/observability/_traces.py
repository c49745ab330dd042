"""Readers for the traces the overlap report understands, all turned into per-stream intervals.

- a Chrome trace written by `overlap.Timeline` (one process per rank, one thread per stream);
- a Chrome trace from ``torch.profiler`` (device kernels per stream when there are any, else host
  ops per thread, where only a process group's own work, such as ``gloo:all_to_all``, is
  communication), plain or gzip-compressed; the toolkit's launches in it are found by their
  ``record_function`` names (`overlap.hooks.launch_name`): on the host, the ops inside a launch of
  kind ``issue`` are the host's time issuing a communication stream's operation, no busy time, as
  in the toolkit's own timeline;
- a folder of such Chrome traces, the toolkit's or torch.profiler's (one per rank, as
  ``torch.profiler.tensorboard_trace_handler`` writes them: ``*.json``, ``*.json.gz``), read file by
  file: a process named alike in two files is told apart by its file's name;
- a torch_npu profiler output folder: ``trace_view.json`` ("Ascend Hardware" lanes per physical
  stream: ``args["Physic Stream Id"]``, which is also the ``tid``), else ``kernel_details.csv``
  (needs ``Stream ID``, the logical stream, i.e. profiler Level1 or above), plus
  ``step_trace_time.csv`` when present for the profiler's own overlapped-communication figure.

On the NPU a stream's kind is decided by what it carries: a stream with any hcom / HCCL task is a
communication stream, and all of its tasks are communication (HCCL runs SDMA, Memcpy,
Reduce_Inline and Notify tasks there, not named like hcom ops; a notify wait there is the
collective waiting for its peers). An event wait elsewhere holds a stream without working on it.

Every reader raises `TraceError` naming the file and what is missing or malformed.
"""
from __future__ import annotations

import bisect
import collections
import csv
import dataclasses
import gzip
import io
import itertools
import json
import math
import os
import re
import stat
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..hooks import LaunchName, parse_launch_name
from .timeline import GENERATOR
Item = Tuple[str, str, str, float, float]  # process, stream, kind, start s, end s

COMM_PATTERN = re.compile(r"nccl|hccl|hcom|gloo|c10d|all_?reduce|all_?to_?all|all_?gather|reduce_?scatter|"
                          r"broadcast|dispatch|combine|send|recv", re.IGNORECASE)
# On a host thread only a process group's own work is communication ("gloo:all_to_all" on gloo's threads): an
# operator named like one ("aten::broadcast_tensors", the sanitizer's "PythonDispatchMode") is compute.
HOST_COMM_PATTERN = re.compile(r"(gloo|nccl|hccl|mpi|ucc)[:_]", re.IGNORECASE)
# Tasks that hold a stream while it waits for another stream are not work on it.
WAIT_PATTERN = re.compile(r"wait", re.IGNORECASE)
HCCL_PATTERN = re.compile(r"hcom|hccl|communication", re.IGNORECASE)  # an NPU task of a collective
NOTIFY_PATTERN = re.compile(r"notify", re.IGNORECASE)  # HCCL's own synchronisation with the peers
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation", "gpu_user_annotation")
_HOST_RANGE, _DEVICE_RANGE = "user_annotation", "gpu_user_annotation"  # a record_function range on each side
TRACE_SUFFIXES = (".json", ".json.gz")  # the files of a folder of Chrome traces
KERNEL_DETAILS, STEP_TRACE, TRACE_VIEW = "kernel_details.csv", "step_trace_time.csv", "trace_view.json"
NPU_OUTPUT = "ASCEND_PROFILER_OUTPUT"
# Longest duration or distance from a trace's first event, in microseconds: past 2**53 us (~285 years)
# a float no longer holds whole microseconds, so such a time is corrupt, not measured.
MAX_US = float(2 ** 53)


class TraceError(ValueError):
    """A trace file or folder that cannot be read; the message names the file and the problem."""


class ProfiledLaunch(NamedTuple):
    """One of the toolkit's launches found by its name in a profiler trace: where its range ran (the process and
    the lane of the trace's items: a host thread, or a device stream), what it was, and when (seconds)."""

    process: str
    lane: str
    name: LaunchName
    start: float
    end: float


@dataclasses.dataclass
class Trace:
    """What a report is computed from."""

    source: str
    format: str
    items: List[Item] = dataclasses.field(default_factory=list)
    # torch_npu's own figures per process: communication and its overlapped part, seconds
    profiler_overlap: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    launches: List[ProfiledLaunch] = dataclasses.field(default_factory=list)  # the toolkit's, in a profiler trace
    files: List[str] = dataclasses.field(default_factory=list)  # a folder's trace files, as read
    left_out: List[str] = dataclasses.field(default_factory=list)  # a folder's JSON files read as no trace, and why

    def processes(self) -> List[str]:
        """Every process (rank, device) the trace names."""
        names = {i[0] for i in self.items} | {launch.process for launch in self.launches} | set(self.profiler_overlap)
        return sorted(names)


def classify(name: str) -> str:
    return "comm" if COMM_PATTERN.search(name) else "compute"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _num(value: Any, source: str, what: str) -> float:
    try:
        return float(str(value).strip())
    except (TypeError, ValueError):
        raise TraceError(f"{source}: {what} is {_short(value)}, not a number") from None


def _time(value: Any, source: str, what: str, duration: bool = False) -> float:
    """A timestamp (any finite number) or a duration (finite, >= 0, at most `MAX_US`) in microseconds."""
    x = _num(value, source, what)
    if not math.isfinite(x):
        raise TraceError(f"{source}: {what} is {_short(value)}, not a finite number")
    if duration and x < 0:
        raise TraceError(f"{source}: {what} is {x:g}, a negative duration")
    if duration and x > MAX_US:
        raise TraceError(f"{source}: {what} is {x:g} us, longer than 2**53 us (~285 years): corrupt")
    return x


def _not_a_file(mode: int) -> Optional[str]:
    """What a path that is not a regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _read_bytes(source: str) -> bytes:
    """The whole of the regular file ``source``, never waiting for data: opened without blocking (a pipe
    swapped in after a check cannot hold the open), refused unless it is a regular file, read up to the
    size it had when opened."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceError(f"{source}: cannot read it ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        what = _not_a_file(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            raise TraceError(f"{source}: a folder, not a trace file")
        if what is not None:
            raise TraceError(f"{source}: {what}, not a regular file or a folder: the report reads trace files "
                             f"and profiler folders only")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:  # truncated while read: what is there is what the readers judge
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise TraceError(f"{source}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)


def _read_text(source: str) -> str:
    raw = _read_bytes(source)
    if raw[:2] == b"\x1f\x8b":  # gzip, as tensorboard_trace_handler(use_gzip=True) writes
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{source}: not a trace: a damaged gzip file ({e})") from None
    if not raw or raw.isspace():
        raise TraceError(f"{source}: empty file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"{source}: not a trace: a binary file (not UTF-8 text at byte {e.start})") from None
    if "\x00" in text:
        raise TraceError(f"{source}: not a trace: a binary file (NUL byte at offset {text.index(chr(0))})")
    return text


def read_json(source: str) -> Any:
    text = _read_text(source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}); is the file truncated?") from None
    except RecursionError:
        raise TraceError(f"{source}: not a trace: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise TraceError(f"{source}: not valid JSON ({str(e).split(';')[0]})") from None


def _describe(data: Any) -> str:
    if isinstance(data, dict):
        keys = ", ".join(map(repr, list(data)[:5])) + (", ..." if len(data) > 5 else "")
        return f"an object with keys {keys}" if data else "an empty object"
    return {str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")


def trace_events(data: Any, source: str) -> List[Dict[str, Any]]:
    """The trace's events, each checked to be an object whose fields the readers can use."""
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{source}: not a trace: no 'traceEvents' list (the JSON is {_describe(data)})")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceError(f"{source}: not a trace: event {i} is {_short(e)}, not an object")
        if not isinstance(e.get("args", {}), dict):
            raise TraceError(f"{source}: 'args' of event {i} is {_short(e['args'])}, not an object")
        for key in ("pid", "tid"):
            if isinstance(e.get(key), (list, dict)):
                raise TraceError(f"{source}: {key!r} of event {i} is {_short(e[key])}, not a number or a name")
    return events


def trace_metadata(data: Any, key: str) -> Dict[str, Any]:
    """An optional top-level object of a trace; empty when absent or not an object."""
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def is_toolkit_trace(data: Any, events: List[Dict[str, Any]]) -> bool:
    """A trace written by `overlap.Timeline`: ``otherData.generator`` says so in the JSON object format; in
    the bare-array format, which has no such field, every complete event is as the toolkit writes it
    (``args`` with its rank, stream and kind, ``cat`` the kind)."""
    if trace_metadata(data, "otherData").get("generator") == GENERATOR:
        return True
    slices = [e for e in events if e.get("ph") == "X"]
    return isinstance(data, list) and bool(slices) and all(
        {"rank", "stream", "kind"} <= set(e.get("args", {})) and e.get("cat") == e["args"]["kind"] for e in slices)


def complete_slices(events: List[Dict[str, Any]], source: str, text_times: bool = False
                    ) -> List[Tuple[Dict[str, Any], float, float]]:
    """Complete ("X") events with start and end in seconds since the file's first event. Their ``ts`` and ``dur``
    are JSON numbers (not strings, not booleans); ``text_times``: numbers written as text are read too (msprof
    writes its trace_view.json so)."""
    raw = []
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        for field in ("ts", "dur"):
            if field not in e:
                raise TraceError(f"{source}: event {i} ({e.get('name')!r}) has no {field!r} field")
            if not text_times:
                _check_json_number(e[field], source, f"{field!r} of event {i} ({_short(e.get('name'))})")
        ts = f"'ts' of event {i}"
        raw.append((e, _time(e["ts"], source, ts), _time(e["dur"], source, f"'dur' of event {i}", True), ts))
    return _relative(raw, source)


def _check_json_number(value: Any, source: str, what: str) -> None:
    """`TraceError` unless ``value`` is a JSON number: a string or a boolean is an edit, not a time."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{source}: {what} is {_short(value)}, not a number (a trace's times are JSON numbers)")


def _relative(raw: List[Tuple[Any, float, float, str]], source: str) -> List[Tuple[Any, float, float]]:
    """``(x, start us, duration us, what the start is)`` as ``(x, start s, end s)`` since the first start."""
    # microsecond timestamps since the epoch lose precision when scaled to seconds: subtract first
    origin = min((ts for _, ts, _, _ in raw), default=0.0)
    out = []
    for x, ts, dur, what in raw:
        if ts - origin + dur > MAX_US:
            raise TraceError(f"{source}: {what} is {ts:g}: the event ends {ts - origin + dur:g} us after the first "
                             f"one, beyond 2**53 us (~285 years): corrupt")
        out.append((x, (ts - origin) * 1e-6, (ts - origin + dur) * 1e-6))
    return out


def named_ids(events: List[Dict[str, Any]], kind: str) -> Dict[Any, str]:
    key = (lambda e: e.get("pid")) if kind == "process_name" else (lambda e: (e.get("pid"), e.get("tid")))
    return {key(e): str(e.get("args", {}).get("name")) for e in events if e.get("ph") == "M" and e.get("name") == kind}


def _toolkit(events: List[Dict[str, Any]], source: str) -> List[Item]:
    procs, threads = named_ids(events, "process_name"), named_ids(events, "thread_name")
    return [(procs.get(e.get("pid"), f"rank {e.get('pid')}"),
             threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))),
             str(e.get("cat") or classify(str(e.get("name", "")))), s, t)
            for e, s, t in complete_slices(events, source)]


def _launches(slices: List[Tuple[Dict[str, Any], float, float]], category: str, place: Any) -> List[ProfiledLaunch]:
    """The toolkit's launches among the ``category`` ranges, each placed by ``place(event)`` -> (process, lane)."""
    out = []
    for e, s, t in slices:
        if e.get("cat") == category:
            name = parse_launch_name(str(e.get("name", "")))
            if name is not None:
                out.append(ProfiledLaunch(*place(e), name, s, t))
    return out


def _kind_inside(launches: List[ProfiledLaunch]) -> Any:
    """``kind(process, lane, start)``: the kind of the innermost launch whose range holds ``start`` on that lane,
    None outside every launch."""
    by_lane: Dict[Tuple[str, str], List[ProfiledLaunch]] = {}
    for launch in sorted(launches, key=lambda x: x.start):
        by_lane.setdefault((launch.process, launch.lane), []).append(launch)
    starts = {k: [x.start for x in v] for k, v in by_lane.items()}
    reach = {k: list(itertools.accumulate((x.end for x in v), max)) for k, v in by_lane.items()}  # latest end so far

    def kind(process: str, lane: str, start: float) -> Optional[str]:
        ranges, ends = by_lane.get((process, lane), []), reach.get((process, lane), [])
        i = bisect.bisect_right(starts.get((process, lane), []), start) - 1
        while i >= 0 and start < ends[i]:  # the latest started range that holds ``start``: nested ones come later
            if start < ranges[i].end:
                return ranges[i].name.kind
            i -= 1
        return None
    return kind


def _torch_profiler(data: Any, events: List[Dict[str, Any]], source: str) -> Tuple[List[Item], List[ProfiledLaunch]]:
    rank = trace_metadata(data, "distributedInfo").get("rank")
    prefix = "" if rank is None else f"rank {rank} "
    slices = complete_slices(events, source)
    device = [x for x in slices if x[0].get("cat") in _DEVICE_CATS]

    def on_device(e: Dict[str, Any]) -> Tuple[str, str]:
        return f"{prefix}device {e.get('pid')}", f"stream {e.get('args', {}).get('stream', e.get('tid'))}"

    def on_host(e: Dict[str, Any]) -> Tuple[str, str]:
        return f"{prefix}process {e.get('pid')}", f"thread {e.get('tid')}"

    items: List[Item] = []
    if device:
        for e, s, t in device:
            kind = "copy" if e.get("cat") != "kernel" else classify(str(e.get("name", "")))
            items.append((*on_device(e), kind, s, t))
        return items, _launches(slices, _DEVICE_RANGE, on_device)
    launches = _launches(slices, _HOST_RANGE, on_host)
    inside = _kind_inside(launches)
    for e, s, t in slices:
        name = str(e.get("name", ""))
        # the launching thread's c10d op only enqueues (or waits for) work run on the backend's threads
        if e.get("cat") in _HOST_CATS and not name.startswith("c10d::"):
            process, lane = on_host(e)
            # inside a launch an op is what the launch is: compute, or the host issuing an exchange
            kind = inside(process, lane, s) or ("comm" if HOST_COMM_PATTERN.match(name) else "compute")
            items.append((process, lane, kind, s, t))
    if slices and not items:
        raise TraceError(f"{source}: {len(slices)} complete slices, none the report can place: not an overlap "
                         f"timeline, a torch.profiler trace (categories {', '.join(_DEVICE_CATS + _HOST_CATS)}) "
                         f"or a torch_npu trace_view.json")
    return items, launches


def _npu_kinds(tasks: List[Tuple[str, str, str, Any]]) -> List[Tuple[str, str, Any]]:
    """``(stream, name, task type, x)`` of NPU tasks as ``(stream, kind, x)``, stream waits left out.

    A stream that carries any hcom / HCCL task is a communication stream: all its tasks count as
    communication, its notify waits included (see the module docstring).
    """
    hccl = {stream for stream, name, task, _ in tasks if HCCL_PATTERN.search(name) or HCCL_PATTERN.search(task)}
    out = []
    for stream, name, task, x in tasks:
        text = f"{name} {task}"
        if WAIT_PATTERN.search(text) and not (stream in hccl and NOTIFY_PATTERN.search(text)):
            continue
        out.append((stream, "comm" if stream in hccl else classify(name), x))
    return out


def _hardware_stream(e: Dict[str, Any]) -> str:
    """The physical stream of an "Ascend Hardware" task (msprof writes no other stream id there)."""
    sid = e.get("args", {}).get("Physic Stream Id")
    return f"Stream {e.get('tid') if sid is None else sid}"


def _ascend_hardware(events: List[Dict[str, Any]], source: str, process: str) -> Tuple[List[Item], Optional[Tuple]]:
    procs = named_ids(events, "process_name")
    hw = {pid for pid, name in procs.items() if name == "Ascend Hardware"}
    if not hw:
        raise TraceError(f"{source}: no 'Ascend Hardware' process (no process_name metadata event with that name)")
    tasks = []
    comm: List[Tuple[float, float]] = []
    not_overlapped: List[Tuple[float, float]] = []
    analysis = {pid for pid, name in procs.items() if name == "Overlap Analysis"}
    for e, s, t in complete_slices(events, source, text_times=True):
        name = str(e.get("name", ""))
        if e.get("pid") in hw:
            tasks.append((_hardware_stream(e), name, str(e.get("args", {}).get("Task Type", "")), (s, t)))
        elif e.get("pid") in analysis:
            if name == "Communication":
                comm.append((s, t))
            elif name == "Communication(Not Overlapped)":
                not_overlapped.append((s, t))
    items = [(process, stream, kind, s, t) for stream, kind, (s, t) in _npu_kinds(tasks)]
    if not items:
        raise TraceError(f"{source}: the 'Ascend Hardware' process has no complete ('X') task events")
    summary = None
    if comm:
        from ._intervals import length, union

        total, exposed = length(union(comm)), length(union(not_overlapped))
        summary = (total, total - exposed)
    return items, summary


def _read_csv(source: str, required: Tuple[str, ...], hint: str = "") -> List[Tuple[int, Dict[str, str]]]:
    """The data rows with their line numbers; `TraceError` without the ``required`` columns."""
    reader = csv.DictReader(io.StringIO(_read_text(source), newline=""))
    rows = []
    try:
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{source}: missing column(s) {', '.join(map(repr, missing))}{hint}")
        for row in reader:
            extra = row.pop(None, None)  # type: ignore[call-overload]
            if extra and any(c.strip() for c in extra):
                raise TraceError(f"{source}: line {reader.line_num} has {len(header) + len(extra)} cells, "
                                 f"the header {len(header)}: malformed CSV")
            rows.append((reader.line_num, {(k or "").strip(): (v or "").strip() for k, v in row.items()}))
    except csv.Error as e:
        raise TraceError(f"{source}: malformed CSV ({e})") from None
    if not rows:
        raise TraceError(f"{source}: no data rows")
    return rows


def _kernel_details(source: str, process: str) -> List[Item]:
    rows = _read_csv(source, ("Stream ID", "Start Time(us)", "Duration(us)"),
                     " (at profiler Level0 there is no 'Stream ID': profile with profiler_level=Level1 or higher)")
    tasks = []
    for i, r in rows:
        if not r.get("Start Time(us)") and not r.get("Duration(us)"):
            continue
        task = r.get("Type", "") + " " + r.get("Accelerator Core", "")
        start = f"'Start Time(us)' on line {i}"
        times = (_time(r["Start Time(us)"], source, start),
                 _time(r["Duration(us)"], source, f"'Duration(us)' on line {i}", True), start)
        tasks.append((f"Stream {r['Stream ID']}", r.get("Name", ""), task, times))
    raw = [((stream, kind), ts, dur, what) for stream, kind, (ts, dur, what) in _npu_kinds(tasks)]
    return [(process, stream, kind, s, t) for (stream, kind), s, t in _relative(raw, source)]


def _step_trace(source: str) -> Tuple[float, float]:
    comm = exposed = 0.0
    for i, r in _read_csv(source, ("Communication", "Communication(Not Overlapped)")):
        c = _time(r["Communication"], source, f"'Communication' on line {i}", True)
        x = _time(r["Communication(Not Overlapped)"], source, f"'Communication(Not Overlapped)' on line {i}", True)
        if x > c:
            raise TraceError(f"{source}: 'Communication(Not Overlapped)' on line {i} is {x:g}, "
                             f"more than 'Communication' ({c:g})")
        comm += c
        exposed += x
    return comm * 1e-6, (comm - exposed) * 1e-6


def _walk_error(e: OSError) -> None:
    raise TraceError(f"{e.filename}: cannot read it ({e.strerror})")


def _npu_output_dirs(root: str) -> List[str]:
    """The folders holding profiler output: ``root`` itself, else every ASCEND_PROFILER_OUTPUT below it."""
    files = (TRACE_VIEW, KERNEL_DETAILS, STEP_TRACE)
    if any(os.path.isfile(os.path.join(root, f)) for f in files):
        return [root]
    found = []
    # a folder that cannot be listed would otherwise drop its ranks from the report without a word
    for dirpath, dirs, _names in os.walk(root, onerror=_walk_error):
        base = os.path.basename(os.path.normpath(dirpath))
        if base == NPU_OUTPUT:
            found.append(dirpath)
        elif base.endswith("_ascend_pt") and NPU_OUTPUT not in dirs:
            raise TraceError(f"{dirpath}: a torch_npu profile without an {NPU_OUTPUT} folder: not parsed yet?")
    return sorted(found)


def _process_name(out_dir: str, root: str) -> str:
    if os.path.basename(out_dir) == NPU_OUTPUT:
        out_dir = os.path.dirname(out_dir)
    rel = os.path.relpath(out_dir, root)
    return os.path.basename(os.path.abspath(out_dir)) if rel == "." else rel


def _load_npu_folder(root: str, dirs: List[str]) -> Trace:
    trace = Trace(root, "torch_npu profiler folder")
    for d in dirs:
        process = _process_name(d, root)
        view, kernels, steps = (os.path.join(d, f) for f in (TRACE_VIEW, KERNEL_DETAILS, STEP_TRACE))
        if not any(os.path.isfile(f) for f in (view, kernels, steps)):
            raise TraceError(f"{d}: none of {TRACE_VIEW}, {KERNEL_DETAILS} or {STEP_TRACE} is a readable file in it "
                             f"(not parsed yet, or exported only as .db?)")
        if os.path.isfile(view):
            items, summary = _ascend_hardware(trace_events(read_json(view), view), view, process)
            trace.items += items
            if summary:
                trace.profiler_overlap[process] = summary
        elif os.path.isfile(kernels):
            trace.items += _kernel_details(kernels, process)
        if os.path.isfile(steps):
            trace.profiler_overlap[process] = _step_trace(steps)
    return trace


def _trace_files(root: str) -> List[str]:
    """The Chrome trace files (`TRACE_SUFFIXES`) directly in the folder ``root``, by name."""
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        raise TraceError(f"{root}: cannot read it ({e.strerror})") from None
    paths = (os.path.join(root, n) for n in names if n.endswith(TRACE_SUFFIXES))
    return [p for p in paths if os.path.isfile(p)]


def _load_trace_folder(root: str, files: List[str]) -> Trace:
    """Every trace file of a folder, read as alone; a JSON file holding no trace (such as the launcher's
    results.json) or a plan (a prediction) is left out and named."""
    traces, left_out = [], []
    for f in files:
        base = os.path.basename(f)
        data = read_json(f)
        if isinstance(data, dict) and "traceEvents" not in data:
            left_out.append(f"{base} (no traceEvents: not a trace)")
            continue
        if isinstance(trace_metadata(data, "otherData").get("prediction"), dict):
            left_out.append(f"{base} (a plan: predicted, not measured)")
            continue
        trace = _from_json(f, data)
        if not trace.items and not trace.profiler_overlap:
            raise TraceError(f"{f}: no timed events (complete 'X' slices) found in it")
        traces.append(trace)
    if not traces:
        raise TraceError(f"{root}: no trace among its {len(files)} JSON file(s): {', '.join(left_out)}")
    owners: Dict[str, set] = collections.defaultdict(set)
    for t in traces:
        for p in t.processes():
            owners[p].add(t.source)
    folder = Trace(root, _folder_format(traces), files=[t.source for t in traces], left_out=left_out)
    for t in traces:
        named = {p: p if len(owners[p]) == 1 else f"{p} ({os.path.basename(t.source)})" for p in t.processes()}
        folder.items += [(named[i[0]], *i[1:]) for i in t.items]
        folder.launches += [launch._replace(process=named[launch.process]) for launch in t.launches]
        folder.profiler_overlap.update({named[p]: v for p, v in t.profiler_overlap.items()})
    return folder


def _folder_format(traces: List[Trace]) -> str:
    formats = collections.Counter(t.format for t in traces)
    if len(formats) == 1:
        return f"folder of {len(traces)} {next(iter(formats))} file(s)"
    return f"folder of {len(traces)} trace files: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items()))


def _load_folder(root: str) -> Trace:
    dirs = _npu_output_dirs(root)
    if dirs:
        return _load_npu_folder(root, dirs)
    files = _trace_files(root)
    if files:
        return _load_trace_folder(root, files)
    raise TraceError(f"{root}: nothing to read here: no Chrome trace file ({', '.join('*' + x for x in TRACE_SUFFIXES)}"
                     f": torch.profiler's or this toolkit's) in it, and no torch_npu profiler output ({TRACE_VIEW}, "
                     f"{KERNEL_DETAILS} or {STEP_TRACE} in it or in an {NPU_OUTPUT} folder below it)")


def _from_json(source: str, data: Any) -> Trace:
    """The trace in the JSON ``data`` read from ``source``: the toolkit's, torch_npu's or torch.profiler's."""
    events = trace_events(data, source)
    if is_toolkit_trace(data, events):
        layout = "" if isinstance(data, dict) else ", JSON array format"
        return Trace(source, f"overlap timeline{layout}", _toolkit(events, source))
    base = os.path.basename(source)
    if "Ascend Hardware" in named_ids(events, "process_name").values():
        items, summary = _ascend_hardware(events, source, base)
        return Trace(source, "torch_npu trace_view.json", items, {base: summary} if summary else {})
    items, launches = _torch_profiler(data, events, source)
    return Trace(source, "torch.profiler Chrome trace", items, launches=launches)


def load(source: str) -> Trace:
    """Read any supported trace file or folder; `TraceError` when it cannot."""
    if os.path.isdir(source):
        return _load_folder(source)
    if not os.path.exists(source):
        raise TraceError(f"{source}: no such file or folder")
    base = os.path.basename(source)
    if base.endswith(".csv"):
        if base == STEP_TRACE or "step_trace" in base:
            return Trace(source, "torch_npu step_trace_time.csv", profiler_overlap={base: _step_trace(source)})
        return Trace(source, "torch_npu kernel_details.csv", _kernel_details(source, base))
    return _from_json(source, read_json(source))


# ---- named tasks: what ``overlap-report --points`` reads (the names and fields the busy-time items drop) ----

class Task(NamedTuple):
    """One timed task with its name: where it ran (process, lane), what it was, when (seconds since the trace's
    first event) and its fields (a toolkit span's meta; a profiler row's columns, such as ``Block Dim``)."""

    process: str
    lane: str
    name: str
    kind: str
    start: float
    end: float
    fields: Dict[str, Any]


EVENT_WAIT_PATTERN = re.compile(r"event_?wait", re.IGNORECASE)  # a stream held until another stream's event


def _toolkit_tasks(events: List[Dict[str, Any]], source: str) -> List[Task]:
    procs, threads = named_ids(events, "process_name"), named_ids(events, "thread_name")
    return [Task(procs.get(e.get("pid"), f"rank {e.get('pid')}"), threads.get((e.get("pid"), e.get("tid")),
                                                                             str(e.get("tid"))),
                 str(e.get("name", "")), str(e.get("cat") or classify(str(e.get("name", "")))), s, t,
                 dict(e.get("args", {}))) for e, s, t in complete_slices(events, source)]


def _profiler_tasks(data: Any, events: List[Dict[str, Any]], source: str) -> List[Task]:
    """A torch.profiler trace's device kernels per stream, else its host ops per thread."""
    rank = trace_metadata(data, "distributedInfo").get("rank")
    prefix = "" if rank is None else f"rank {rank} "
    slices = complete_slices(events, source)
    device = [x for x in slices if x[0].get("cat") in _DEVICE_CATS]
    if device:
        return [Task(f"{prefix}device {e.get('pid')}", f"stream {e.get('args', {}).get('stream', e.get('tid'))}",
                     str(e.get("name", "")), classify(str(e.get("name", ""))), s, t, dict(e.get("args", {})))
                for e, s, t in device]
    return [Task(f"{prefix}process {e.get('pid')}", f"thread {e.get('tid')}", str(e.get("name", "")), "compute",
                 s, t, dict(e.get("args", {}))) for e, s, t in slices if e.get("cat") in _HOST_CATS]


def _hardware_tasks(events: List[Dict[str, Any]], source: str, process: str) -> List[Task]:
    hw = {pid for pid, name in named_ids(events, "process_name").items() if name == "Ascend Hardware"}
    return [Task(process, _hardware_stream(e), str(e.get("name", "")), classify(str(e.get("name", ""))), s, t,
                 dict(e.get("args", {}))) for e, s, t in complete_slices(events, source, text_times=True)
            if e.get("pid") in hw]


def _kernel_tasks(source: str, process: str) -> List[Task]:
    """``kernel_details.csv``'s rows, stream waits included (``EVENT_WAIT``: the join's hold on a stream)."""
    rows = _read_csv(source, ("Name", "Stream ID", "Start Time(us)", "Duration(us)"))
    raw = []
    for i, r in rows:
        if not r.get("Start Time(us)") and not r.get("Duration(us)"):
            continue
        start = f"'Start Time(us)' on line {i}"
        raw.append((r, _time(r["Start Time(us)"], source, start),
                    _time(r["Duration(us)"], source, f"'Duration(us)' on line {i}", True), start))
    return [Task(process, f"Stream {r['Stream ID']}", r.get("Name", ""), classify(r.get("Name", "")), s, t, r)
            for r, s, t in _relative(raw, source)]


def _npu_folder_tasks(root: str) -> List[Task]:
    out: List[Task] = []
    for d in _npu_output_dirs(root):
        process = _process_name(d, root)
        kernels, view = os.path.join(d, KERNEL_DETAILS), os.path.join(d, TRACE_VIEW)
        if os.path.isfile(kernels):  # it has Block Dim and the waits' task types
            out += _kernel_tasks(kernels, process)
        elif os.path.isfile(view):
            out += _hardware_tasks(trace_events(read_json(view), view), view, process)
    return out


def _json_tasks(source: str, data: Any) -> Tuple[str, List[Task]]:
    events = trace_events(data, source)
    if is_toolkit_trace(data, events):
        return "toolkit", _toolkit_tasks(events, source)
    if "Ascend Hardware" in named_ids(events, "process_name").values():
        return "profiler", _hardware_tasks(events, source, os.path.basename(source))
    return "profiler", _profiler_tasks(data, events, source)


def named_tasks(source: str) -> Tuple[str, List[Task]]:
    """Every timed task of ``source`` with its name and fields, and whose trace it is: ``"toolkit"`` (written by
    `overlap.Timeline`, spans naming their operation and its data flow) or ``"profiler"``; `TraceError` when it
    cannot be read or holds no task."""
    if os.path.isdir(source):
        if _npu_output_dirs(source):
            found: Tuple[str, List[Task]] = ("profiler", _npu_folder_tasks(source))
        else:
            files = _trace_files(source)
            parts = [_json_tasks(f, read_json(f)) for f in files]
            whose = {w for w, _ in parts}
            found = ("toolkit" if whose == {"toolkit"} else "profiler", [t for _, ts in parts for t in ts])
    elif not os.path.exists(source):
        raise TraceError(f"{source}: no such file or folder")
    elif os.path.basename(source).endswith(".csv"):
        found = ("profiler", _kernel_tasks(source, os.path.basename(source)))
    else:
        found = _json_tasks(source, read_json(source))
    if not found[1]:
        raise TraceError(f"{source}: no timed tasks (complete 'X' slices or task rows) found in it")
    return found
