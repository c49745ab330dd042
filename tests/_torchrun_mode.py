"""The suite under torchrun: every rank runs the same tests, decides together, and rank 0 reports.

``torchrun --nproc-per-node N -m pytest tests -p no:xdist -p no:cacheprovider`` runs the whole
suite on every rank; multi-rank tests use the ranks torchrun made (`overlap.multirank.run_ranks`).
So that no rank is ever left waiting in a collective its peers will not issue:

- the ranks check that they collected the same tests, in the same order;
- after each phase of each test (setup, call, teardown) they exchange its outcome through
  torchrun's store: a failure on any rank fails the test on every rank, and a skip on any rank
  (a marker, a missing extra, too few ranks) skips it on every rank, so the next test starts
  together;
- outside `run_ranks` bodies a test sees no process group (as with spawned ranks), so code that
  defaults to the world group runs single-process there;
- rank 0 prints the one report, with the ranks each failure came from; the other ranks are
  silent (``OVERLAP_TEST_ALL_RANKS=1`` keeps their output). Every rank exits with the same status.

A rank that stops answering (dead, or hung past every bound) ends the session on every rank with
a message naming it, after ``OVERLAP_TEST_TIMEOUT`` seconds (default 900).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Dict, List, Tuple

import pytest
import torch.distributed as dist

from overlap import _torchrun
from overlap.multirank import DEFAULT_TIMEOUT, RankTimeout

ENV_ALL_RANKS = "OVERLAP_TEST_ALL_RANKS"
ENV_TEST_TIMEOUT = "OVERLAP_TEST_TIMEOUT"
_TEXT_LIMIT = 6000


def _summary(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return report.longreprtext[-_TEXT_LIMIT:] if report.failed else ""


class TorchrunMode:
    """Registered by the suite's conftest when it runs under torchrun."""

    def __init__(self, config: pytest.Config) -> None:
        _torchrun.ensure_initialized(DEFAULT_TIMEOUT)
        _torchrun.hide_group_outside_bodies()  # tests see what they see with spawned ranks
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = float(os.environ.get(ENV_TEST_TIMEOUT, "900"))
        self.step = 0
        self.failed_on: Dict[Tuple[str, str], List[int]] = {}  # (nodeid, phase) -> ranks
        if config.option.basetemp:
            raise pytest.UsageError("--basetemp under torchrun: every rank would clear the others' files; "
                                    "leave it out (each rank gets its own temporary root)")
        # ranks on one host must not share (and clean up) one numbered pytest-of-<user> folder
        root = os.path.join(tempfile.gettempdir(), f"overlap-torchrun-rank{self.rank}")
        os.makedirs(root, exist_ok=True)
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
        if self.rank != 0 and os.environ.get(ENV_ALL_RANKS, "") in ("", "0"):
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)

    def _exchange(self, what: str, value: object) -> Dict[int, object]:
        key = f"pytest/{self.step}"
        try:
            got = _torchrun.exchange(key, value, range(self.world), self.timeout)
        except RankTimeout as e:
            pytest.exit(f"torchrun mode: {e}; stopping on every rank that still answers", returncode=1)
        if self.step:
            _torchrun.forget(f"pytest/{self.step - 1}")
        self.step += 1
        return got

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: List[pytest.Item]) -> None:
        ids = [item.nodeid for item in items]
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        got = self._exchange("collection", (digest, len(ids)))
        if len(set(got.values())) > 1:
            listed = "; ".join(f"rank {r}: {n} tests ({d[:12]})" for r, (d, n) in sorted(got.items()))
            pytest.exit(f"torchrun mode: the ranks collected different tests ({listed}); every rank must see "
                        f"the same files, extras and options", returncode=4)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        got = self._exchange(call.when, (item.nodeid, call.when, report.outcome, _summary(report)))
        where = {r: v[0] for r, v in got.items()}
        if len(set(where.values())) > 1:
            listed = "; ".join(f"rank {r}: {w}" for r, w in sorted(where.items()))
            pytest.exit(f"torchrun mode: the ranks are out of step ({listed})", returncode=1)
        failed = {r: v[3] for r, v in got.items() if v[2] == "failed"}
        skipped = {r: v[3] for r, v in got.items() if v[2] == "skipped"}
        if failed:
            self.failed_on[(item.nodeid, call.when)] = sorted(failed)
            if not report.failed:
                first = min(failed)
                report.outcome = "failed"
                report.longrepr = (f"failed on rank(s) {sorted(failed)} of {self.world} (passed here, on rank "
                                   f"{self.rank}); rank {first}:\n{failed[first]}")
        elif skipped and not report.skipped:
            first = min(skipped)
            report.outcome = "skipped"
            path, line, _ = item.location
            report.longrepr = (path, (line or 0) + 1, f"skipped on rank {first}: {skipped[first]}")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_sep("=", f"torchrun mode: {self.world} ranks, outcomes decided together")
        if not self.failed_on:
            terminalreporter.write_line("no test failed on any rank")
        for (nodeid, when), ranks in self.failed_on.items():
            phase = "" if when == "call" else f" (in {when})"
            terminalreporter.write_line(f"FAILED {nodeid}{phase} on rank(s) {', '.join(map(str, ranks))}")
