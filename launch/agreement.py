"""Every rank of a job agrees on the job before the first collective.

Ranks started with different options would build different models, run different schedules or
issue different collectives: a mixed model that ``--check`` accepts, a hang, or a native abort in
gloo / HCCL. So right after joining the group, and before any collective, each rank posts in the
rendezvous store what must be equal on every rank (the model, the modes, the seed, ...), its own
token count and any problem it found on its own (not enough memory, an unwritable ``--out``), and
reads everyone's. A difference or a problem is one `JobMismatch` on every rank, naming the option
(or the problem) and the ranks. `agree_ready` does the same after a step each rank takes on its own
(loading its part of a checkpoint), so that a rank that cannot go on stops every rank before the
collective that would wait for it.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist

from .config import ConfigError, JobConfig

_PREFIX = "overlap/job"
_DEFAULT_FROM = {"--cpu-link": "$OVERLAP_CPU_LINK", "--cpu-comm-priority": "$OVERLAP_CPU_COMM_PRIORITY"}
_MODEL_OPTIONS = {"n_layers": "--layers", "n_dense_layers": "--dense-layers", "hidden": "--hidden",
                  "n_experts": "--experts", "top_k": "--top-k", "n_shared": "--shared-experts"}


class JobMismatch(ConfigError):
    """The ranks of one job do not agree on it, or one of them cannot run it (exit status 2)."""


def fingerprint(job: JobConfig) -> Dict[str, Any]:
    """What must be equal on every rank, by the option or environment variable a user would change
    (JSON-friendly).

    Every option that shapes the run is here. Left out on purpose: ``--batch``, ``--seq-len`` and
    ``--seq-lens`` (each rank brings its own requests; the split is agreed by one all-reduce) and
    ``--out`` (rank 0 writes the results; each rank's mmap KV files go under its own ``--out``).
    The environment variables are those `launch.config.environment` keeps (that docstring says why
    the others need not agree); ``--cpu-link`` and ``--cpu-comm-priority`` take their defaults from
    theirs, which a difference names too (`_DEFAULT_FROM`).
    """
    if job.transformers:
        out = {f"--model (its {k})": v for k, v in job.model_fields().items()}
    else:
        out = {_MODEL_OPTIONS.get(k, f"--preset (model {k})"): v for k, v in job.model_fields().items()}
    out.update({"--model": job.model_name, "--mode": list(job.modes), "--device": job.device, "--path": job.path,
                "--kv-offload": job.kv_offload, "--kv-store": job.kv_store,
                "--dtype": str(job.dtype).replace("torch.", ""), "--warmup": job.warmup, "--iters": job.iters,
                "--seed": job.seed, "--check": job.check,
                "--cpu-link": str(job.link) if job.link else "off", "--cpu-comm-priority": job.comm_priority,
                "--timeout": job.timeout})
    out.update(dict(job.environment))
    return out


def _differences(posts: Sequence[Dict[str, Any]]) -> List[str]:
    first = posts[0]["config"]
    lines = []
    for key in first:
        values = [p["config"].get(key) for p in posts]
        if any(v != values[0] for v in values):
            by_value: Dict[str, List[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(json.dumps(v), []).append(rank)
            named = f"{key} (or its default {_DEFAULT_FROM[key]})" if key in _DEFAULT_FROM else key
            lines.append(f"ranks disagree on {named}: " + "; ".join(
                f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {json.loads(v)!r}" for v, r in by_value.items()))
    return lines


def _exchange(stage: str, post: Dict[str, Any], timeout: float, late: str) -> List[Dict[str, Any]]:
    """Post this rank's ``post`` under ``stage`` in the store and read every rank's (the store only: no
    collective). `JobMismatch` naming the ranks that did not post within ``timeout`` s, as ``late`` says."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{_PREFIX}/{stage}/{rank}", json.dumps(post))
    keys = [f"{_PREFIX}/{stage}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise JobMismatch(f"rank(s) {', '.join(map(str, missing))} did not {late} within --timeout {timeout:g} s") \
            from None
    return [json.loads(store.get(k)) for k in keys]


def _problems(posts: Sequence[Dict[str, Any]]) -> List[str]:
    """Every rank's problems, once each, with the ranks that found it."""
    by_problem: Dict[str, List[int]] = {}
    for r, post in enumerate(posts):
        for p in post["problems"]:
            by_problem.setdefault(p, []).append(r)
    return [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {p}" for p, r in by_problem.items()]


def _raise(lines: Sequence[str]) -> None:
    if lines:
        raise JobMismatch(lines[0] if len(lines) == 1 else "the ranks cannot run this job:\n  " + "\n  ".join(lines))


def agree(job: JobConfig, tokens: int, problems: Sequence[str], timeout: float) -> List[int]:
    """Post this rank's view of the job and check every rank's; returns each rank's token count.

    Raises `JobMismatch` on every rank when the ranks differ or one reported a problem, and when a
    rank does not post within ``timeout`` seconds (naming it).
    """
    posts = _exchange("start", {"config": fingerprint(job), "tokens": int(tokens), "problems": list(problems)},
                      timeout, "reach the start of the job")
    _raise(_problems(posts) + _differences(posts))
    return [p["tokens"] for p in posts]


def agree_ready(stage: str, problem: Optional[str], timeout: float) -> None:
    """After a step every rank takes on its own (loading its part of a checkpoint): `JobMismatch` on every
    rank, with every rank's problem, when one of them could not take it; before any collective needs it."""
    _raise(_problems(_exchange(stage, {"problems": [problem] if problem else []}, timeout, f"finish {stage}")))
