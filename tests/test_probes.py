"""The probes of the link and the busy host (`microbatch.planning.probes`), which the calibration fits."""
import torch

from overlap.multirank import run_ranks


def test_contention_is_nothing_without_peers():
    from microbatch.planning.probes import contention, notice
    assert contention(None, 4, 16, torch.float32, 3) == 0.0  # no group: no collective, no measurement
    assert notice(None, 16, torch.float32) == (0.0, [])


def _probe_pattern(ctx):
    import overlap
    from microbatch.planning import probes

    issued, waited, seen = [0], [0], []
    real_a2a, real_event = overlap.all_to_all_single, overlap.event

    def a2a(*args, **kwargs):
        issued[0] += 1
        seen.append(issued[0] - 1 - waited[0])  # issued before this one and not yet waited for
        return real_a2a(*args, **kwargs)

    class _Waited:
        def __init__(self, name):
            self.ev = real_event(name)

        def record(self):
            self.ev.record()

        def synchronize(self):
            self.ev.synchronize()
            waited[0] += 1

    overlap.all_to_all_single, overlap.event = a2a, _Waited
    try:
        contended, issue = probes._contention(ctx.group, 4, 16, torch.float32, repeats=2, in_flight=4)
        notice_busy, _ = probes.notice(ctx.group, 16, torch.float32, samples=2)
    finally:
        overlap.all_to_all_single, overlap.event = real_a2a, real_event
    return seen, contended, issue, notice_busy


def test_the_contention_probe_issues_one_collective_at_a_time_as_a_schedule_does():
    """Issued eight at once, the collectives' gloo threads woke once for all of them: each measured 0.02-0.05 ms
    of a host's compute where one issued on its own, as the executor issues them, took 0.09-0.14 ms."""
    for seen, contended, issue, busy in run_ranks(_probe_pattern, 2, timeout=120):
        assert seen and max(seen) == 0, seen  # every collective waited for before the next is issued
        assert contended >= 0 and issue > 0 and busy > 0  # a wait takes host time even for a completed exchange
