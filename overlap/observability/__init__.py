"""Seeing what ran where: the timeline (Chrome trace, PNG, metrics), the stream sanitizer, the overlap report.

`Timeline` records every launch through the primitives as a span; `Sanitizer` checks that
streams are ordered (vector clocks on the logical streams, so it runs on CPU); `report` reads a
trace of this toolkit, torch.profiler or torch_npu's profiler (a file, or a folder of one per rank)
and measures the overlap, per operation of this toolkit where a profiler trace names them, and per parallel point
(``overlap-report --points``: `overlap_pct` of a side window and its dominator's, `point_verdict`).
"""
from ._points import FALSE, PARTIAL, REAL, busy_overlap_pct, overlap_pct, point_verdict
from .sanitizer import Sanitizer, StreamRaceError, enable_from_env
from .timeline import Timeline, chrome_trace, find, gather, intersects, metrics, save_chrome_trace, save_png, summary

__all__ = ["FALSE", "PARTIAL", "REAL", "Sanitizer", "StreamRaceError", "Timeline", "busy_overlap_pct", "chrome_trace",
           "enable_from_env",
           "find", "gather", "intersects", "metrics", "overlap_pct", "point_verdict", "save_chrome_trace", "save_png",
           "summary"]
