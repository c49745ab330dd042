"""Readers for the traces the overlap report understands, all turned into per-stream intervals.

- a Chrome trace written by `overlap.Timeline` (one process per rank, one thread per stream);
- a Chrome trace from ``torch.profiler`` (device kernels per stream when there are any, else host
  ops per thread);
- a torch_npu profiler output folder: ``trace_view.json`` ("Ascend Hardware" lanes per Stream Id),
  else ``kernel_details.csv`` (needs ``Stream ID``, i.e. profiler Level1 or above), plus
  ``step_trace_time.csv`` when present for the profiler's own overlapped-communication figure.

Every reader raises `TraceError` naming the file and what is missing or malformed.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

Item = Tuple[str, str, str, float, float]  # process, stream, kind, start s, end s

COMM_PATTERN = re.compile(r"nccl|hccl|hcom|gloo|c10d|all_?reduce|all_?to_?all|all_?gather|reduce_?scatter|"
                          r"broadcast|dispatch|combine|send|recv", re.IGNORECASE)
# Tasks that hold a stream while it waits for another stream are not work on it.
WAIT_PATTERN = re.compile(r"wait", re.IGNORECASE)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation", "gpu_user_annotation")
KERNEL_DETAILS, STEP_TRACE, TRACE_VIEW = "kernel_details.csv", "step_trace_time.csv", "trace_view.json"


class TraceError(ValueError):
    """A trace file or folder that cannot be read; the message names the file and the problem."""


@dataclasses.dataclass
class Trace:
    """What a report is computed from."""

    source: str
    format: str
    items: List[Item] = dataclasses.field(default_factory=list)
    # torch_npu's own figures per process: communication and its overlapped part, seconds
    profiler_overlap: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)


def classify(name: str) -> str:
    return "comm" if COMM_PATTERN.search(name) else "compute"


def _num(value: Any, source: str, what: str) -> float:
    try:
        return float(str(value).strip())
    except (TypeError, ValueError):
        raise TraceError(f"{source}: {what} is {value!r}, not a number") from None


def _load_json(source: str) -> Any:
    try:
        with open(source) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}); is the file truncated?") from None
    except OSError as e:
        raise TraceError(f"{source}: cannot read it ({e.strerror})") from None


def _events(data: Any, source: str) -> List[Dict[str, Any]]:
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{source}: no 'traceEvents' list: not a Chrome trace")
    return [e for e in events if isinstance(e, dict)]


def _slices(events: List[Dict[str, Any]], source: str) -> List[Tuple[Dict[str, Any], float, float]]:
    """Complete ("X") events with start and end in seconds since the file's first event."""
    raw = []
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        for field in ("ts", "dur"):
            if field not in e:
                raise TraceError(f"{source}: event {i} ({e.get('name')!r}) has no {field!r} field")
        raw.append((e, _num(e["ts"], source, f"'ts' of event {i}"), _num(e["dur"], source, f"'dur' of event {i}")))
    return _relative(raw)


def _relative(raw: List[Tuple[Any, float, float]]) -> List[Tuple[Any, float, float]]:
    # microsecond timestamps since the epoch lose precision when scaled to seconds: subtract first
    origin = min((ts for _, ts, _ in raw), default=0.0)
    return [(x, (ts - origin) * 1e-6, (ts - origin + dur) * 1e-6) for x, ts, dur in raw]


def _names(events: List[Dict[str, Any]], kind: str) -> Dict[Any, str]:
    key = (lambda e: e.get("pid")) if kind == "process_name" else (lambda e: (e.get("pid"), e.get("tid")))
    return {key(e): str(e.get("args", {}).get("name")) for e in events if e.get("ph") == "M" and e.get("name") == kind}


def _toolkit(events: List[Dict[str, Any]], source: str) -> List[Item]:
    procs, threads = _names(events, "process_name"), _names(events, "thread_name")
    return [(procs.get(e.get("pid"), f"rank {e.get('pid')}"),
             threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))),
             str(e.get("cat") or classify(str(e.get("name", "")))), s, t)
            for e, s, t in _slices(events, source)]


def _torch_profiler(data: Any, events: List[Dict[str, Any]], source: str) -> List[Item]:
    rank = data.get("distributedInfo", {}).get("rank") if isinstance(data, dict) else None
    prefix = "" if rank is None else f"rank {rank} "
    slices = _slices(events, source)
    device = [x for x in slices if x[0].get("cat") in _DEVICE_CATS]
    items: List[Item] = []
    if device:
        for e, s, t in device:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            kind = "copy" if e.get("cat") != "kernel" else classify(str(e.get("name", "")))
            items.append((f"{prefix}device {e.get('pid')}", f"stream {stream}", kind, s, t))
        return items
    for e, s, t in slices:
        name = str(e.get("name", ""))
        # the launching thread's c10d op only enqueues (or waits for) work run on the backend's threads
        if e.get("cat") in _HOST_CATS and not name.startswith("c10d::"):
            items.append((f"{prefix}process {e.get('pid')}", f"thread {e.get('tid')}", classify(name), s, t))
    return items


def _ascend_hardware(events: List[Dict[str, Any]], source: str, process: str) -> Tuple[List[Item], Optional[Tuple]]:
    procs = _names(events, "process_name")
    hw = {pid for pid, name in procs.items() if name == "Ascend Hardware"}
    if not hw:
        raise TraceError(f"{source}: no 'Ascend Hardware' process (no process_name metadata event with that name)")
    threads = _names(events, "thread_name")
    items: List[Item] = []
    comm: List[Tuple[float, float]] = []
    not_overlapped: List[Tuple[float, float]] = []
    analysis = {pid for pid, name in procs.items() if name == "Overlap Analysis"}
    for e, s, t in _slices(events, source):
        name = str(e.get("name", ""))
        if e.get("pid") in hw:
            args = e.get("args", {})
            task = str(args.get("Task Type", ""))
            if WAIT_PATTERN.search(name) or WAIT_PATTERN.search(task):
                continue
            sid = args.get("Stream Id")
            stream = f"Stream {sid}" if sid is not None else threads.get((e.get("pid"), e.get("tid")),
                                                                         f"Stream {e.get('tid')}")
            kind = "comm" if "HCCL" in task.upper() or "COMMUNICATION" in task.upper() else classify(name)
            items.append((process, stream, kind, s, t))
        elif e.get("pid") in analysis:
            if name == "Communication":
                comm.append((s, t))
            elif name == "Communication(Not Overlapped)":
                not_overlapped.append((s, t))
    if not items:
        raise TraceError(f"{source}: the 'Ascend Hardware' process has no complete ('X') task events")
    summary = None
    if comm:
        from ._intervals import length, union

        total, exposed = length(union(comm)), length(union(not_overlapped))
        summary = (total, total - exposed)
    return items, summary


def _read_csv(source: str, required: Tuple[str, ...], hint: str = "") -> List[Dict[str, str]]:
    try:
        with open(source, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{source}: missing column(s) {', '.join(map(repr, missing))}{hint}")
            rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    except OSError as e:
        raise TraceError(f"{source}: cannot read it ({e.strerror})") from None
    except csv.Error as e:
        raise TraceError(f"{source}: malformed CSV ({e})") from None
    if not rows:
        raise TraceError(f"{source}: no data rows")
    return rows


def _kernel_details(source: str, process: str) -> List[Item]:
    rows = _read_csv(source, ("Stream ID", "Start Time(us)", "Duration(us)"),
                     " (at profiler Level0 there is no 'Stream ID': profile with profiler_level=Level1 or higher)")
    raw = []
    for i, r in enumerate(rows, start=2):
        if not r.get("Start Time(us)") and not r.get("Duration(us)"):
            continue
        name, task = r.get("Name", ""), r.get("Type", "") + " " + r.get("Accelerator Core", "")
        if WAIT_PATTERN.search(name):
            continue
        kind = "comm" if "HCCL" in task.upper() or "COMMUNICATION" in task.upper() else classify(name)
        raw.append(((f"Stream {r['Stream ID']}", kind),
                    _num(r["Start Time(us)"], source, f"'Start Time(us)' on line {i}"),
                    _num(r["Duration(us)"], source, f"'Duration(us)' on line {i}")))
    return [(process, stream, kind, s, t) for (stream, kind), s, t in _relative(raw)]


def _step_trace(source: str) -> Tuple[float, float]:
    rows = _read_csv(source, ("Communication", "Communication(Not Overlapped)"))
    comm = sum(_num(r["Communication"], source, "'Communication'") for r in rows)
    exposed = sum(_num(r["Communication(Not Overlapped)"], source, "'Communication(Not Overlapped)'") for r in rows)
    return comm * 1e-6, (comm - exposed) * 1e-6


def _npu_output_dirs(root: str) -> List[str]:
    files = (TRACE_VIEW, KERNEL_DETAILS, STEP_TRACE)
    if any(os.path.isfile(os.path.join(root, f)) for f in files):
        return [root]
    found = []
    for dirpath, _dirs, names in os.walk(root):
        if os.path.basename(dirpath) == "ASCEND_PROFILER_OUTPUT" and any(f in names for f in files):
            found.append(dirpath)
    return sorted(found)


def _process_name(out_dir: str, root: str) -> str:
    if os.path.basename(out_dir) == "ASCEND_PROFILER_OUTPUT":
        out_dir = os.path.dirname(out_dir)
    rel = os.path.relpath(out_dir, root)
    return os.path.basename(os.path.abspath(out_dir)) if rel == "." else rel


def _load_npu_folder(root: str) -> Trace:
    dirs = _npu_output_dirs(root)
    if not dirs:
        raise TraceError(f"{root}: no torch_npu profiler output here: expected {TRACE_VIEW}, {KERNEL_DETAILS} or "
                         f"{STEP_TRACE} in it or in an ASCEND_PROFILER_OUTPUT folder below it")
    trace = Trace(root, "torch_npu profiler folder")
    for d in dirs:
        process = _process_name(d, root)
        view, kernels, steps = (os.path.join(d, f) for f in (TRACE_VIEW, KERNEL_DETAILS, STEP_TRACE))
        if os.path.isfile(view):
            items, summary = _ascend_hardware(_events(_load_json(view), view), view, process)
            trace.items += items
            if summary:
                trace.profiler_overlap[process] = summary
        elif os.path.isfile(kernels):
            trace.items += _kernel_details(kernels, process)
        if os.path.isfile(steps):
            trace.profiler_overlap[process] = _step_trace(steps)
    return trace


def load(source: str) -> Trace:
    """Read any supported trace file or folder; `TraceError` when it cannot."""
    if os.path.isdir(source):
        return _load_npu_folder(source)
    if not os.path.exists(source):
        raise TraceError(f"{source}: no such file or folder")
    base = os.path.basename(source)
    if base.endswith(".csv"):
        if base == STEP_TRACE or "step_trace" in base:
            return Trace(source, "torch_npu step_trace_time.csv", profiler_overlap={base: _step_trace(source)})
        return Trace(source, "torch_npu kernel_details.csv", _kernel_details(source, base))
    data = _load_json(source)
    events = _events(data, source)
    if isinstance(data, dict) and data.get("otherData", {}).get("generator") == "npu-overlap":
        return Trace(source, "overlap timeline", _toolkit(events, source))
    if "Ascend Hardware" in _names(events, "process_name").values():
        items, summary = _ascend_hardware(events, source, base)
        return Trace(source, "torch_npu trace_view.json", items, {base: summary} if summary else {})
    return Trace(source, "torch.profiler Chrome trace", _torch_profiler(data, events, source))
