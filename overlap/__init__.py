"""Overlap communication with computation: execution paths, tagged streams, events, core limits.

One vocabulary lowers to every path (one backend per path in `overlap.backends`): ``stream(tag)``
places work on a tagged stream, ``event(tag).record() / .wait()`` orders streams, ``wait_tensor``
is an ordering edge, ``record_stream`` keeps memory alive across streams and ``limit_cores``
splits the cores. Beside the primitives: `overlap.observability` (``Timeline``, ``Sanitizer``,
the overlap report), `overlap.offload` (the KV-cache offload stream), `overlap.agreement` (ranks
that must agree check that they do: `agree`, `agree_later`), `overlap.leaving` (how a rank leaves: `exit_rank`,
the end of a multi-rank program), `overlap.peers` (signs of life, so that a wait that runs out names the rank it
waited for: `watch_peers`) and `overlap.multirank` (the multi-rank harness).
Importing the package has no side effect; `reset` forgets the process-wide state (`overlap.state`) and
tells the packages built on it (`on_reset`).
"""
from ._tree import tensors_in
from .agreement import (Disagreement, GroupTransport, PendingAgreement, StoreTransport, agree, agree_later,
                        compare_posts)
from .comm import all_reduce, all_to_all_single, collective_device
from .comm_threads import ENV_COMM_PRIORITY, comm_priority, describe_comm_priority, set_comm_priority
from .context import (DEFAULT, ENV_ENABLE, ENV_PATH, PATHS, current_path, current_stream_tag, detect_path, enabled,
                      is_enabled, set_enabled, set_path, use_path)
from .copy import copy_
from .cores import (CoreBudget, CoreBudgetError, core_budget, limit_cores, parse_budget, read_soc_config,
                    reset_core_limits, set_core_budget, stream_limits)
from .events import Event, event, wait_tensor
from .hooks import Span, add_observer, remove_observer, span
from .host_memory import ENV_KEEP_MEMORY, keep_freed_memory
from .host_sync import HostSync, HostSyncs, host_reads_allowed, no_host_sync
from .leaving import exit_rank, leave_group
from .link import Link, current_link, parse_link, set_link
from .observability import Sanitizer, StreamRaceError, Timeline
from .observability import enable_from_env as sanitize_from_env
from .offload import OffloadCache, OffloadError
from .peers import late_peers, peer_step, set_peer_watch, watch_peers
from .state import WaitTimeout, on_reset, reset, set_wait_timeout, wait_timeout
from .streams import (EP_COMM, INDEXER, KV_OFFLOAD, SHARED_EXPERT, get_stream, issue_ahead, issue_collective,
                      issue_host, record_stream, stream, synchronize)

__all__ = [
    "DEFAULT", "EP_COMM", "INDEXER", "KV_OFFLOAD", "SHARED_EXPERT", "PATHS", "ENV_COMM_PRIORITY", "ENV_ENABLE",
    "ENV_KEEP_MEMORY", "ENV_PATH",
    "CoreBudget", "CoreBudgetError", "Disagreement", "Event", "GroupTransport", "HostSync", "HostSyncs", "Link", "OffloadCache",
    "PendingAgreement",
    "OffloadError", "Sanitizer", "Span", "StoreTransport", "StreamRaceError", "Timeline", "WaitTimeout",
    "add_observer", "agree", "agree_later", "all_reduce", "all_to_all_single", "collective_device", "comm_priority",
    "compare_posts", "copy_", "core_budget",
    "current_link", "current_path", "current_stream_tag", "describe_comm_priority", "detect_path", "enabled",
    "event", "exit_rank", "get_stream", "host_reads_allowed", "is_enabled",
    "issue_ahead", "issue_collective", "issue_host", "keep_freed_memory", "late_peers", "leave_group",
    "limit_cores", "no_host_sync", "on_reset", "parse_budget", "parse_link", "peer_step", "read_soc_config",
    "record_stream", "remove_observer", "reset", "reset_core_limits", "sanitize_from_env", "set_core_budget",
    "set_comm_priority", "set_enabled", "set_link", "set_path", "set_peer_watch", "set_wait_timeout", "span", "stream",
    "stream_limits", "synchronize", "tensors_in", "use_path", "wait_tensor", "wait_timeout",
]
