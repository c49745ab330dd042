"""Per-stream core limits, checked against the device's core budget.

Streams that run in parallel share the AI cores: if their limits add up to more than the device
has, the overlap stops or the device hangs. torchair's rule, checked here: every stream that runs
in parallel gets a share, a stream without a limit (usually the main one) takes the whole device,
and the shares of all of them, the main stream included, fit into the budget. So once a side stream
is limited, the main stream must be limited too: limit it first (``with overlap.limit_cores(16, 32):``
around its work, the side stream's ``limit_cores`` inside or after it). `limit_cores` records the
share of each stream it is used on (the largest limit seen, until `reset_core_limits`) and refuses,
with a `CoreBudgetError` naming every stream and its share, a limit that breaks the rule. The budget
comes from `set_core_budget`, ``$OVERLAP_CORE_BUDGET`` ("aic|aiv", e.g. "24|48") or CANN's
``platform_config/<soc>.ini``; without one only the unlimited main stream is caught.
"""
from __future__ import annotations

import configparser
import contextlib
import dataclasses
import glob
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import backends
from .context import DEFAULT, current_stream_tag, eager_in_trace, is_enabled
from .state import STATE

ENV_BUDGET = "OVERLAP_CORE_BUDGET"
ENV_SOC = "OVERLAP_SOC_VERSION"
_CANN_HOMES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


class CoreBudgetError(ValueError):
    """Core limits that the device cannot honour."""


@dataclasses.dataclass(frozen=True)
class CoreBudget:
    """How many AI (cube) and vector cores the device has, and where that was read."""

    aic: int
    aiv: int
    source: str = "given"


def parse_budget(text: str, source: str = ENV_BUDGET) -> CoreBudget:
    """Parse "aic|aiv" (or "aic" alone, for devices without vector cores)."""
    parts = [p.strip() for p in text.split("|")]
    try:
        aic = int(parts[0])
        aiv = int(parts[1]) if len(parts) > 1 and parts[1] else 0
    except (ValueError, IndexError):
        raise CoreBudgetError(f"{source}: expected 'aic|aiv' such as '24|48', got {text!r}") from None
    if aic < 1 or aiv < 0 or len(parts) > 2:
        raise CoreBudgetError(f"{source}: expected 'aic|aiv' with aic >= 1 and aiv >= 0, got {text!r}")
    return CoreBudget(aic, aiv, source)


def read_soc_config(file: str) -> CoreBudget:
    """Read ``[SoCInfo]`` ``cube_core_cnt`` (or ``ai_core_cnt``) and ``vector_core_cnt`` from a CANN ini."""
    cfg = configparser.ConfigParser()
    if not cfg.read(file):
        raise CoreBudgetError(f"cannot read SoC description {file}")
    if not cfg.has_section("SoCInfo"):
        raise CoreBudgetError(f"{file}: no [SoCInfo] section")
    info = cfg["SoCInfo"]
    aic = info.get("cube_core_cnt") or info.get("ai_core_cnt")
    if aic is None:
        raise CoreBudgetError(f"{file}: [SoCInfo] has neither cube_core_cnt nor ai_core_cnt")
    return CoreBudget(int(aic), int(info.get("vector_core_cnt", "0") or 0), file)


def _soc_version() -> Optional[str]:
    return os.environ.get(ENV_SOC) or backends.current().soc_version()


def find_soc_config(soc: Optional[str] = None) -> Optional[str]:
    """The ``platform_config/<soc>.ini`` of the installed CANN toolkit, if any."""
    soc = soc or _soc_version()
    if not soc:
        return None
    homes = [os.environ[v] for v in _CANN_HOMES if os.environ.get(v)] + ["/usr/local/Ascend/ascend-toolkit/latest"]
    for home in homes:
        hits = sorted(glob.glob(os.path.join(home, "**", "platform_config", f"{soc}.ini"), recursive=True))
        if hits:
            return hits[0]
    return None


def set_core_budget(budget: Optional[CoreBudget]) -> None:
    """Use ``budget`` for validation (None: back to the environment / SoC description)."""
    STATE.core_budget = budget


def env_core_budget() -> Optional[CoreBudget]:
    """``$OVERLAP_CORE_BUDGET``'s budget, None when unset or empty; `CoreBudgetError` (a ValueError) naming it
    for anything but ``aic|aiv`` with aic >= 1 and aiv >= 0."""
    env = os.environ.get(ENV_BUDGET, "")
    return parse_budget(env) if env.strip() else None


def core_budget() -> Optional[CoreBudget]:
    """The device's core budget, or None when it cannot be known."""
    if STATE.core_budget is not None:
        return STATE.core_budget
    env = env_core_budget()
    if env is not None:
        return env
    ini = find_soc_config()
    return read_soc_config(ini) if ini else None


def reset_core_limits() -> None:
    """Forget the limits recorded so far (e.g. between models)."""
    with STATE.lock:
        STATE.core_limits.clear()


def stream_limits() -> Dict[str, Tuple[int, int]]:
    """The limit recorded for each stream tag."""
    with STATE.lock:
        return dict(STATE.core_limits)


def _check_values(aic: Any, aiv: Any, budget: Optional[CoreBudget]) -> None:
    """Core counts torch_npu and torchair accept: aic >= 1; aiv >= 1 on chips with vector cores, else 0."""
    call = f"limit_cores(aic={aic!r}, aiv={aiv!r})"
    if not (isinstance(aic, int) and isinstance(aiv, int)):
        raise CoreBudgetError(f"{call}: aic must be an int >= 1 and aiv an int")
    if aic < 1:
        raise CoreBudgetError(f"{call}: aic must be an int >= 1, got {aic}")
    if budget is not None and budget.aiv == 0:
        if aiv != 0:
            raise CoreBudgetError(f"{call}: the device has no vector cores ({_pair(budget.aic, budget.aiv)} from "
                                  f"{budget.source}): aiv must be 0, got {aiv}")
    elif aiv < 1:
        # torch_npu sends 0 as a limit of 0 cores (only -1 leaves it); torchair accepts [1, max]
        raise CoreBudgetError(f"{call}: aiv must be an int >= 1 on a chip with vector cores, got {aiv} "
                              f"(0 is valid only where the device has none: set the budget to 'aic|0')")
    if budget is not None and (aic > budget.aic or aiv > budget.aiv):
        raise CoreBudgetError(f"{call}: more than the device's {_pair(budget.aic, budget.aiv)} from {budget.source}")


def _pair(aic: int, aiv: int) -> str:
    return f"{aic}|{aiv}"


def _shares(limits: Dict[str, Tuple[int, int]], budget: Optional[CoreBudget]) -> List[str]:
    """Each parallel stream and its share, the main stream first (unlimited: the whole device)."""
    whole = "the whole device" + (f", {_pair(budget.aic, budget.aiv)}" if budget is not None else "")
    main = limits.get(DEFAULT)
    out = [f"{DEFAULT}: " + (_pair(*main) if main else f"unlimited ({whole})")]
    return out + [f"{t}: {_pair(a, v)}" for t, (a, v) in sorted(limits.items()) if t != DEFAULT]


def _check_split(limits: Dict[str, Tuple[int, int]], budget: Optional[CoreBudget]) -> None:
    """Refuse shares that do not fit into the device; the main stream always runs in parallel."""
    hint = ("streams that run in parallel must share the device: a stream without a limit takes the whole of it. "
            "Limit the main stream too, first (with overlap.limit_cores(aic, aiv): around its work, the side "
            "stream's limit inside or after it); call overlap.reset_core_limits() between phases whose streams "
            "never run in parallel")
    if DEFAULT not in limits and limits:
        side = ", ".join(sorted(limits))
        raise CoreBudgetError(f"oversubscribed cores: {side} limited while the main stream {DEFAULT!r} is not "
                              f"({'; '.join(_shares(limits, budget))}); {hint}")
    if budget is None:
        return
    total_aic = sum(a for a, _ in limits.values())
    total_aiv = sum(v for _, v in limits.values())
    if total_aic > budget.aic or total_aiv > budget.aiv:
        raise CoreBudgetError(f"core limits of streams that run in parallel add up to {_pair(total_aic, total_aiv)} "
                              f"(aic|aiv), more than the device's {_pair(budget.aic, budget.aiv)} from "
                              f"{budget.source} ({'; '.join(_shares(limits, budget))}); {hint}")


@eager_in_trace  # reads files and the environment: plain Python even while Dynamo traces
def _check(tag: str, aic: int, aiv: int) -> None:
    budget = core_budget()
    _check_values(aic, aiv, budget)
    with STATE.lock:
        old = STATE.core_limits.get(tag, (0, 0))
        new = dict(STATE.core_limits)
        new[tag] = (max(old[0], aic), max(old[1], aiv))
        _check_split(new, budget)
        STATE.core_limits[tag] = new[tag]


@contextlib.contextmanager
def limit_cores(aic: int, aiv: int) -> Iterator[None]:
    """Limit the operators launched in the block to ``aic`` cube and ``aiv`` vector cores.

    The limit is the current stream's share of the device (see the module docstring: limit the
    main stream before a side stream). ``ge``: ``torchair.scope.limit_core_num``; ``aclgraph``:
    npugraph_ex's ``limit_core_num``; ``npu``: ``torch.npu.set_stream_limit`` on the current stream,
    the enclosing limit put back on exit; ``cuda`` / ``cpu``: validated, otherwise a no-op.
    """
    if not is_enabled():
        yield
        return
    _check(current_stream_tag(), aic, aiv)
    scope = backends.current().core_scope(aic, aiv)
    if scope is None:
        yield
    else:
        with scope:
            yield
