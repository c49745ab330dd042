"""Overlap communication with computation: execution paths, tagged streams, events, core limits.

One vocabulary lowers to every path (README, docs/graph-mode.md): ``stream(tag)`` places work on a tagged
stream, ``event(tag).record() / .wait()`` orders streams, ``wait_tensor`` is an ordering edge,
``record_stream`` keeps memory alive across streams and ``limit_cores`` splits the cores.
``Timeline`` records what ran where and when, ``Sanitizer`` checks that streams are ordered.
"""
from .comm import all_reduce, all_to_all_single
from .copy import copy_
from .cores import (CoreBudget, CoreBudgetError, core_budget, limit_cores, parse_budget, read_soc_config,
                    reset_core_limits, set_core_budget, stream_limits)
from .events import Event, event, wait_tensor
from .link import Link, current_link, parse_link, set_link
from .offload import OffloadCache, OffloadError
from .hooks import Span, add_observer, remove_observer, span
from .paths import (ENV_ENABLE, ENV_PATH, PATHS, current_path, detect_path, enabled, is_enabled, set_enabled,
                    set_path, use_path)
from .streams import (COMM, COPY, MAIN, SHARED, current_stream_tag, get_stream, launch_collective, launch_host,
                      record_stream, stream, synchronize)
from .sanitizer import Sanitizer, StreamRaceError, enable_from_env as _sanitize_from_env
from .timeline import Timeline

__all__ = [
    "COMM", "COPY", "MAIN", "SHARED", "PATHS", "ENV_ENABLE", "ENV_PATH",
    "CoreBudget", "CoreBudgetError", "Event", "Link", "OffloadCache", "OffloadError", "Sanitizer", "Span", "StreamRaceError", "Timeline",
    "add_observer", "all_reduce", "all_to_all_single", "copy_", "core_budget", "current_link", "current_path",
    "current_stream_tag", "detect_path", "enabled", "event", "get_stream", "is_enabled", "launch_collective",
    "launch_host", "limit_cores", "parse_budget", "parse_link", "read_soc_config", "record_stream", "remove_observer",
    "reset_core_limits", "set_core_budget", "set_enabled", "set_link", "set_path", "span", "stream", "stream_limits",
    "synchronize", "use_path", "wait_tensor",
]

_sanitize_from_env()  # $OVERLAP_SANITIZE=1 or =raise checks stream ordering in this process
