"""The toolkit's environment variables, checked for a launcher run, and those that shape it (what every rank
must agree on, `launch.agreement.fingerprint`); the compute threads a rank takes (`compute_threads`)."""
from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import overlap

from .errors import ConfigError

__all__ = ["ENV_THREADS", "EnvValue", "compute_threads", "environment"]

EnvValue = Union[str, int, None]  # the value of an environment variable that shapes the run, as agreed
ENV_THREADS = "OMP_NUM_THREADS"  # torch's intra-op threads: the user's word where set


def compute_threads(local_ranks: int, cores: Optional[int] = None) -> Tuple[int, str]:
    """The threads each rank computes with, and where that number comes from (for the headline): ``$OMP_NUM_THREADS``
    where the user set it, else this process's cores (``cores``: its CPU affinity) less one, shared by the
    ``local_ranks`` ranks of this node, at least 1. The core left over runs what a device would run beside the
    compute: gloo's and the simulated link's threads, the copy thread. torchrun sets 1 per rank with several ranks
    on a node; one rank alone got every core from torch, whose threads then wait for one another on a busy host (a
    1-rank generation on 2 busy cores: 643 ms to the first token with 2 threads, 129 ms with 1)."""
    text = os.environ.get(ENV_THREADS, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"${ENV_THREADS} must be a positive number of threads, got {text!r} (unset it: the "
                              f"launcher then takes the cores less one, shared by the ranks of the node)")
        return int(text), f"${ENV_THREADS}"
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = max(1, local_ranks)
    return max(1, (cores - 1) // ranks), f"{cores} cores less one, {ranks} rank(s) on this node"


def environment(device: str, path: Optional[str]) -> Tuple[Tuple[str, EnvValue], ...]:
    """The toolkit's environment variables, checked for a run on ``device`` (``path``: ``--path``, None for
    the device's eager path): ``(("$NAME", value), ...)`` of those that shape the run, which every rank must
    agree on (`launch.agreement.fingerprint`); a `ConfigError` naming a variable with a bad value.

    Every ``OVERLAP_*`` variable the toolkit reads is checked here, bad values refused even where the
    launcher does not use them. Those left out of the agreement, and why:

    - ``OVERLAP_PATH``: must name this run's path, which ``--device`` / ``--path`` choose (and the ranks
      agree on); anything else is refused, so no thread of the job can lower on another path;
    - ``OVERLAP_GRAPH_PATH``: the lowering of a compiled region with no path set; the launcher compiles
      under ``--path`` (``overlap.use_path``);
    - ``OVERLAP_CPU_LINK``, ``OVERLAP_CPU_COMM_PRIORITY``: the defaults of ``--cpu-link`` and
      ``--cpu-comm-priority``, agreed on as those options;
    - ``OVERLAP_CALIBRATION_CACHE``: each rank's own folder; `microbatch.planning.calibrate` checks that
      every rank found the same calibration and measures again, on every rank, where they differ;
    - ``OVERLAP_FAULT``: the tests' fault injection, meant for one rank;
    - ``OVERLAP_RANK_TIMEOUT``, ``OVERLAP_TEST_TIMEOUT``, ``OVERLAP_START_METHOD``: the test harness's
      (`overlap.multirank`), not read by the launcher.
    """
    from overlap.comm_threads import env_comm_priority
    from overlap.context import ENV_PATH, env_enabled, env_graph_path, env_path
    from overlap.cores import ENV_BUDGET, ENV_SOC, env_core_budget
    from overlap.host_memory import ENV_KEEP_MEMORY, env_keep_memory
    from overlap.link import env_link
    from overlap.observability.sanitizer import ENV_SANITIZE, env_mode

    from launch.health import Fault

    try:
        forced = env_path()
        env_graph_path()
        env_link()
        env_comm_priority()
        keep_memory = env_keep_memory()
        enabled = env_enabled()
        sanitize = env_mode() or "off"
        budget = env_core_budget()
        Fault.from_env()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_path = path or device
    if forced is not None and forced != run_path:
        raise ConfigError(f"{ENV_PATH}={forced} but this run's path is {run_path}: --device and --path choose the "
                          f"launcher's path (unset {ENV_PATH}, or pass --device / --path)")
    out: List[Tuple[str, EnvValue]] = [
        (f"${overlap.ENV_ENABLE}", "on" if enabled else "off"),  # off: every mode runs single-stream
        (f"${ENV_SANITIZE}", sanitize),  # a rank that checks ordering runs slower, and raise stops it
        # the core budget limit_cores checks against (the launcher sets no limit yet: the same job must
        # not pass on one rank and fail on another once it does)
        (f"${ENV_BUDGET}", None if budget is None else f"{budget.aic}|{budget.aiv}"),
        (f"${ENV_SOC}", os.environ.get(ENV_SOC, "").strip() or None),
        # the CPU path's freed host memory kept (overlap.host_memory): the steps' and calibrations' times differ
        (f"${ENV_KEEP_MEMORY}", None if device != "cpu" else "off" if keep_memory is False else "on"),
    ]
    if device == "npu":  # HCCL sizes every communicator's buffer from it, and MC2's window must fit alike
        from collectives.mc2 import ENV_BUFFSIZE, MC2Error, hccl_buffsize_mb

        try:
            out.append((f"${ENV_BUFFSIZE}", hccl_buffsize_mb()[0]))
        except MC2Error as exc:
            raise ConfigError(str(exc)) from None
    return tuple(out)
