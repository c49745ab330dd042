"""Fitting a prefill calibration (`microbatch.planning.prefill.fit`): lines, and serial runs on synthetic timelines."""
import pytest

import overlap
from microbatch import Interconnect, Linear, Transfer
from microbatch.planning.prefill.fit import Run, fit_collective, fit_linear, fit_runs
from overlap import DEFAULT, Span


def test_fit_linear_recovers_the_line_and_clamps_it():
    xs = [32, 64, 96, 128]
    f = fit_linear(xs, [2e-4 + 3e-6 * x for x in xs])
    assert (f.a, f.b) == pytest.approx((2e-4, 3e-6))
    assert fit_linear(xs, [5.0 - x * 0.01 for x in xs]) == Linear(pytest.approx(5.0 - 0.8), 0.0)  # no negative slope
    through = fit_linear(xs, [-1.0 + 0.1 * x for x in xs])  # no negative intercept: through the origin
    assert through.a == 0.0 and through.b > 0
    assert fit_linear([64, 64], [1.0, 3.0]) == Linear(2.0, 0.0)
    assert fit_linear([], []) == Linear()


def test_fit_linear_relative_keeps_the_small_end():
    xs = [32, 108, 362, 1218, 4096]
    ys = [2e-4 + 3e-6 * x for x in xs]
    ys[-1] *= 1.1  # 10% of noise at the largest count
    absolute, relative = fit_linear(xs, ys), fit_linear(xs, ys, relative=True)
    assert abs(absolute(32) / ys[0] - 1) > 0.2  # the intercept pays for the large point
    assert abs(relative(32) / ys[0] - 1) < 0.05
    assert fit_linear(xs[:4], ys[:4], relative=True) == Linear(pytest.approx(2e-4), pytest.approx(3e-6))


# known costs (seconds: a + b * tokens) of a dense layer and two MoE layers; layer 2's experts cost 4x layer 1's
COSTS = {"attn": (4e-4, 3e-6), "mlp": (1e-4, 1e-6), "gate": (5e-5, 2e-7), "dispatch": (3e-4, 2e-6),
         "experts": (2e-4, 1e-6), "combine": (1e-4, 5e-7), "finalize": (6e-5, 1e-7)}
LAYERS = [["attn", "mlp"], ["attn", "gate", "dispatch", "experts", "combine", "finalize"]]
MOE = [False, True, True]
GAP = 20e-6
FRAME = (1e-3, 4e-6)  # embedding, final norm: outside the executor's launches
COMM = {"dispatch": [("dispatch.counts", 160, 0, 1e-4, True), ("dispatch", 64, 200, 5e-4, False)],
        "combine": [("combine", 64, 200, 4e-4, False)]}  # name, bytes a, bytes b, seconds, host-read


def _synthetic_run(tokens, jitter=0.0, drift=0.0):
    """A serial run of known costs; ``drift``: seconds per token the count exchange waits beyond them."""
    spans, nbytes, blocking = [], {}, set()
    t = 0.0
    for li, moe in enumerate(MOE):
        for op in LAYERS[moe]:
            a, b = COSTS[op]
            work = (a + b * tokens) * (4 if (op, li) == ("experts", 2) else 1) * (1 + jitter)
            start, t = t, t + work
            for name, ba, bb, seconds, host_read in COMM.get(op, ()):
                seconds += drift * tokens if host_read else 0.0
                c = Span(name, DEFAULT, "comm", 0, t, t + seconds, {"mb": 0, "layer": li})
                spans.append(c)
                nbytes[c.id] = ba + bb * tokens
                if host_read:
                    blocking.add(c.id)
                t += seconds
            kind = "issue" if op in COMM else "compute"
            spans.append(Span(op, DEFAULT, kind, 0, start, t, {"mb": 0, "layer": li}))
            t += GAP
    spans.append(Span("embed", DEFAULT, "compute", 0, -1.0, -0.5))  # no layer: not an operation of the executor
    wall = (t - GAP) + FRAME[0] + FRAME[1] * tokens  # the whole prefill: the launches and the frame around them
    return Run(tokens, spans, nbytes, blocking, wall)


def test_each_collective_waits_per_token_what_the_serial_runs_show_beyond_the_interconnect():
    drift = 2e-6  # the count exchange waits 2 us more per token: the ranks drift apart over longer compute
    runs = [_synthetic_run(n, jitter, drift) for n in (32, 64, 128) for jitter in (0.0, 0.5)]
    assert all(t.wait_s == t.wait_per_token == 0.0 for t in fit_runs(runs, MOE).transfers)  # no interconnect given
    link = Interconnect(latency_s=1e-4, seconds_per_byte=1e-7)
    cal = fit_runs(runs, MOE, link)
    waits = {t.name: (t.wait_s, t.wait_per_token) for t in cal.transfers}
    # a line through the origin, least squares over the medians per token count: the count exchange's span is
    # 1e-4 + drift * n against the link's 1e-4 + 1.6e-5, so its slope is a little under the drift
    beyond = {n: 1e-4 + drift * n - link.seconds(160) for n in (32, 64, 128)}
    slope = sum(n * w for n, w in beyond.items()) / sum(n * n for n in beyond)
    assert waits["dispatch.counts"] == pytest.approx((0.0, slope)) and 0.9 * drift < slope < drift
    # the payloads' spans are constant while their bytes grow: no wait grows with them (never below none)
    assert waits["dispatch"] == waits["combine"] == (0.0, 0.0)
    # so a batch split in two waits, in all, what it waits whole: the drift is the compute's, not the exchange's
    counts = cal.cost_model().op(1, "dispatch").transfers[0]
    assert counts.wait(50) + counts.wait(50) == pytest.approx(counts.wait(100)) and counts.wait(100) > 0


def test_fit_on_synthetic_timelines_recovers_the_costs():
    runs = [_synthetic_run(n, jitter) for n in (32, 64, 128, 256) for jitter in (0.0, 0.0, 0.5)]  # one slow repeat
    cal = fit_runs(runs, MOE)
    assert cal.tokens == [32, 64, 128, 256] and cal.layers == MOE
    assert cal.host_overhead_s == pytest.approx(GAP)
    assert cal.frame == pytest.approx(FRAME) and cal.cost_model().frame(100) == pytest.approx(1e-3 + 4e-4)
    fits = {(f.op, f.moe): (f.a, f.b) for f in cal.ops}
    for op, ab in COSTS.items():  # the comm ops' cost is their host part: the collectives are taken out
        if op != "experts":
            assert fits[op, True if op != "mlp" else False] == pytest.approx(ab, rel=1e-6), op
    assert fits["attn", False] == pytest.approx(COSTS["attn"], rel=1e-6)
    transfers = [(t.op, t.name, t.a, t.b, t.blocking) for t in cal.transfers]
    assert transfers == [("combine", "combine", pytest.approx(64), pytest.approx(200), False),
                         ("dispatch", "dispatch.counts", pytest.approx(160), 0.0, True),
                         ("dispatch", "dispatch", pytest.approx(64), pytest.approx(200), False)]
    model = cal.cost_model()
    a, b = COSTS["experts"]
    assert model.op(1, "experts").compute(100) == pytest.approx(a + b * 100, rel=1e-6)  # each layer its own fit
    assert model.op(2, "experts").compute(100) == pytest.approx(4 * (a + b * 100), rel=1e-6)
    assert model.op(1, "attn") == model.op(2, "attn")  # alike layers share their kind's fit
    assert model.op(1, "dispatch").transfers[0] == Transfer("dispatch.counts", Linear(160, 0.0), True)
    assert model.op(0, "mlp").transfers == ()


def test_collective_cost_beyond_the_link():
    link = overlap.Link(gbps=1.0, latency_us=100)
    samples = [(n, link.seconds(n) + 2e-4 + 3e-9 * n + jitter) for n in (1000, 10 ** 5, 10 ** 6)
               for jitter in (0.0, 0.0, 1e-3)]
    assert fit_collective(samples, link) == pytest.approx((2e-4, 3e-9))
    assert fit_collective(samples, None)[0] == pytest.approx(2e-4 + 1e-4)
