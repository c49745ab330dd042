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

A rank that stops responding (frozen, dead, its node unreachable: its heartbeat has not moved for
``OVERLAP_RANK_TIMEOUT`` seconds, 90 by default; see `overlap._torchrun`) is named by every rank
still running where it next waits for it: the test in progress fails on each of them with that
rank named, the suite stops there (exit status 1), and the summary names the rank and the test. A
rank that is alive but does not finish a phase of a test within ``OVERLAP_TEST_TIMEOUT`` seconds
(900 by default) stops the suite the same way.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import pytest
import torch.distributed as dist

from overlap import _torchrun
from overlap.multirank import RankTimeout, default_timeout, seconds_from_env

ENV_ALL_RANKS = "OVERLAP_TEST_ALL_RANKS"
ENV_TEST_TIMEOUT = "OVERLAP_TEST_TIMEOUT"
DEFAULT_TEST_TIMEOUT_S = 900.0
_TEXT_LIMIT = 6000


def _summary(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return report.longreprtext[-_TEXT_LIMIT:] if report.failed else ""


class TorchrunMode:
    """Registered by the suite's conftest when it runs under torchrun."""

    def __init__(self, config: pytest.Config) -> None:
        try:  # a bad value: one line naming the variable, before joining the job
            rank_timeout = default_timeout()
            self.timeout = seconds_from_env(ENV_TEST_TIMEOUT, DEFAULT_TEST_TIMEOUT_S)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        _torchrun.ensure_initialized(rank_timeout)
        _torchrun.hide_group_outside_bodies()  # tests see what they see with spawned ranks
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.failed_on: Dict[Tuple[str, str], List[int]] = {}  # (nodeid, phase) -> ranks
        self.notes: Dict[Tuple[str, str], str] = {}  # (nodeid, phase) -> why, when not the test's own failure
        self.stopped: Optional[str] = None  # why the suite stopped early: a peer stopped responding or fell behind
        self.live: List[int] = list(range(self.world))
        if config.option.basetemp:
            raise pytest.UsageError("--basetemp under torchrun: every rank would clear the others' files; "
                                    "leave it out (each rank gets its own temporary root)")
        # ranks on one host must not share (and clean up) one numbered pytest-of-<user> folder
        root = os.path.join(tempfile.gettempdir(), f"overlap-torchrun-rank{self.rank}")
        os.makedirs(root, exist_ok=True)
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
        self.quiet = self.rank != 0 and os.environ.get(ENV_ALL_RANKS, "") in ("", "0")
        if self.quiet:
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)
        self.config = config

    def _exchange(self, value: object) -> Dict[int, object]:
        """Every rank's ``value`` for the next step; `RankTimeout` when a peer stopped responding or fell behind."""
        key = f"pytest/{self.step}"
        got = _torchrun.exchange(key, value, range(self.world), self.timeout)
        if self.step:
            _torchrun.forget(f"pytest/{self.step - 1}")
        self.step += 1
        return got

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: List[pytest.Item]) -> None:
        ids = [item.nodeid for item in items]
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        try:
            got = self._exchange((digest, len(ids)))
        except RankTimeout as e:
            pytest.exit(f"torchrun mode: {e}; no test ran", returncode=1)
        if len(set(got.values())) > 1:
            listed = "; ".join(f"rank {r}: {n} tests ({d[:12]})" for r, (d, n) in sorted(got.items()))
            pytest.exit(f"torchrun mode: the ranks collected different tests ({listed}); every rank must see "
                        f"the same files, extras and options", returncode=4)

    def _stop(self, item: pytest.Item, when: str, report: pytest.TestReport, why: str, note: str) -> None:
        """The ranks can no longer decide together: this test fails here, saying why, and the suite stops
        (after this test's teardown; exit status 1). Not `pytest.exit`: raised in this hook it would be
        buried in a warning, and the summary would not name the test."""
        self.failed_on[(item.nodeid, when)] = self.live
        self.notes[(item.nodeid, when)] = note
        self.stopped = f"{why}; the suite stopped in {item.nodeid} on every rank still running"
        if report.failed:
            report.sections.append(("torchrun mode", why))
        else:
            was, report.outcome = report.outcome, "failed"
            report.longrepr = f"{why}\n(on rank {self.rank} itself this {when} {was})"
        item.session.shouldfail = self.stopped

    def _peer_lost(self, item: pytest.Item, when: str, report: pytest.TestReport, e: RankTimeout) -> None:
        missing = [r for r in e.missing if r != self.rank]
        self.live = [r for r in range(self.world) if r not in missing]
        gone = ", ".join(f"rank {r}" for r in missing) or "a peer"
        lost = _torchrun.lost_ranks()
        note = (f"{gone} stopped responding" if any(r in lost for r in missing)
                else f"{gone} did not finish it within {ENV_TEST_TIMEOUT} {self.timeout:g} s")
        self._stop(item, when, report, f"torchrun mode: {e}", note)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        if self.stopped:
            return  # the suite is ending: no peer left to agree with
        try:
            got = self._exchange((item.nodeid, call.when, report.outcome, _summary(report)))
        except RankTimeout as e:
            self._peer_lost(item, call.when, report, e)
            return
        where = {r: v[0] for r, v in got.items()}
        if len(set(where.values())) > 1:
            listed = "; ".join(f"rank {r}: {w}" for r, w in sorted(where.items()))
            self._stop(item, call.when, report, f"torchrun mode: the ranks are out of step ({listed})",
                       "the ranks are out of step")
            return
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

    def _summary_lines(self) -> List[str]:
        lines = [] if self.failed_on else ["no test failed on any rank"]
        for (nodeid, when), ranks in self.failed_on.items():
            phase = "" if when == "call" else f" (in {when})"
            note = self.notes.get((nodeid, when))
            lines.append(f"FAILED {nodeid}{phase} on rank(s) {', '.join(map(str, ranks))}"
                         + (f" ({note})" if note else ""))
        if self.stopped:
            lines.append(self.stopped)
        return lines

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_sep("=", f"torchrun mode: {self.world} ranks, outcomes decided together")
        for line in self._summary_lines():
            terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Rank 0 reports; when rank 0 itself stopped responding, the lowest rank still running does."""
        if not (self.quiet and self.stopped and 0 not in self.live and self.rank == min(self.live)):
            return
        text = "\n".join([f"torchrun mode: {self.world} ranks (rank {self.rank} reports: rank 0 stopped)"]
                         + self._summary_lines())
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print(text, file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)
