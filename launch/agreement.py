"""Every rank of a job agrees on the job before the first collective.

Ranks started with different options would build different models, run different schedules or
issue different collectives: a mixed model that ``--check`` accepts, a hang, or a native abort in
gloo / HCCL. So right after joining the group, and before any collective, each rank posts in the
rendezvous store what must be equal on every rank (the model, the modes, the seed, ...), its own
token count and any problem it found on its own (not enough memory, an unwritable ``--out``), and
reads everyone's (`overlap.agree` through the store). A difference or a problem is one
`JobMismatch` on every rank, naming the option (or the problem) and each rank's value.
`agree_ready` does the same after a step each rank takes on its own (loading its part of a
checkpoint), so that a rank that cannot go on stops every rank before the collective that would
wait for it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist

from overlap import agreement

from .config import OVERRIDE_OPTIONS, ConfigError, JobConfig

_PREFIX = "overlap/job"
_DEFAULT_FROM = {"--cpu-link": "$OVERLAP_CPU_LINK", "--cpu-comm-priority": "$OVERLAP_CPU_COMM_PRIORITY"}


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
        out = {OVERRIDE_OPTIONS.get(k, f"--preset (model {k})"): v for k, v in job.model_fields().items()}
    out.update({"--model": job.model_name, "--mode": list(job.modes), "--device": job.device, "--path": job.path,
                "--kv-offload": job.kv_offload, "--kv-store": job.kv_store,
                "--dtype": str(job.dtype).replace("torch.", ""), "--warmup": job.warmup, "--iters": job.iters,
                "--seed": job.seed, "--check": job.check,
                "--cpu-link": str(job.link) if job.link else "off", "--cpu-comm-priority": job.comm_priority,
                "--dispatch": job.dispatch, "--dispatch-dtype": job.dispatch_name, "--timeout": job.timeout,
                "--auto-split-margin": job.split_margin, "--refresh-calibration": job.refresh_calibration,
                "--indexer-stream": job.indexer_stream, "--quantize": job.quantize})
    out.update(dict(job.environment))
    return out


def _named(key: str) -> str:
    """An option's name in a message, with the variable its default comes from."""
    return f"{key} (or its default {_DEFAULT_FROM[key]})" if key in _DEFAULT_FROM else key


def _store(stage: str, timeout: float, late: str) -> agreement.StoreTransport:
    """Torchrun's rendezvous store as the transport of ``stage`` (no collective), waiting at most ``timeout`` s."""
    store = dist.distributed_c10d._get_default_store()
    return agreement.StoreTransport(store, f"{_PREFIX}/{stage}", dist.get_rank(), dist.get_world_size(), timeout,
                                    f"{late} within --timeout {timeout:g} s")


def agree(job: JobConfig, own: Mapping[str, int], problems: Sequence[str], timeout: float,
          extra: Optional[Dict[str, Any]] = None) -> List[Dict[str, int]]:
    """Post this rank's view of the job (and ``extra``: more options that must be equal, by name) and check every
    rank's (`overlap.agree` through the store); returns each rank's ``own`` values (its token count, its requests:
    gathered beside the fingerprint, not compared), in rank order.

    Raises `JobMismatch` on every rank when the ranks differ or one reported a problem, and when a
    rank does not post within ``timeout`` seconds (naming it).
    """
    values = {_named(k): v for k, v in {**fingerprint(job), **(extra or {})}.items()}
    posted = {name: f"(this rank's {name})" for name in own}
    values.update({posted[name]: int(value) for name, value in own.items()})
    posts = agreement.agree(values, _store("start", timeout, "reach the start of the job"), problems=problems,
                            per_rank=tuple(posted.values()), error=JobMismatch)
    return [{name: p[key] for name, key in posted.items()} for p in posts]


def agree_ready(stage: str, problem: Optional[str], timeout: float) -> None:
    """After a step every rank takes on its own (loading its part of a checkpoint): `JobMismatch` on every
    rank, with every rank's problem, when one of them could not take it; before any collective needs it."""
    agreement.agree({}, _store(stage, timeout, f"finish {stage}"), problems=[problem] if problem else [],
                    error=JobMismatch)
