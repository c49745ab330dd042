"""What the launcher writes under ``--out``: results.json, and per mode a Chrome trace and a PNG timeline."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, List, Sequence

from overlap.observability import save_chrome_trace, save_png


def write_outputs(out_dir: str, job: Any, results: Sequence[Any], tokens: int, world: int, failed: List[str],
                  say: Any) -> None:
    """Write ``out_dir``/results.json and each mode's ``trace_<mode>.json`` / ``timeline_<mode>.png``.

    ``job`` is the `launch.config.JobConfig`; ``failed`` the modes ``--check`` rejected; ``say``
    prints a line for the user.
    """
    os.makedirs(out_dir, exist_ok=True)
    pngs = True
    for r in results:
        save_chrome_trace(r.spans, os.path.join(out_dir, f"trace_{r.mode}.json"))
        if pngs:
            try:
                save_png(r.spans, os.path.join(out_dir, f"timeline_{r.mode}.png"),
                         title=f"{r.mode}: {world} rank(s), {tokens} tokens")
            except ImportError:
                pngs = False
                say("(matplotlib is not installed: no PNG timelines; pip install 'npu-overlap[plot]')")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"world_size": world, "device": job.device, "dtype": str(job.dtype).replace("torch.", ""),
                   "seq_lens": list(job.seq_lens), "config": dataclasses.asdict(job.model),
                   "kv_offload": job.kv_offload, "cpu_link": str(job.link) if job.link else None,
                   "rows": [r.row(tokens) for r in results],
                   "check": None if not job.check else ("failed" if failed else "passed")}, f, indent=2)
    say(f"wrote {out_dir}/results.json, trace_<mode>.json" + (" and timeline_<mode>.png" if pngs else ""))
