"""The benchmarks' verdicts and differences decided from given figures: the offload benchmark's overhead and hidden
copy time, the executor benchmark's differences and targets (the pipeline benchmark's: tests/test_measure.py)."""
from launch.bench.executor import difference, outside_line, targets
from launch.bench.offload import hidden_line, overhead_line


def test_the_offload_overhead_is_a_figure_only_beyond_the_spread_and_its_target_says_when_noise_covers_it():
    assert overhead_line(100.0, 125.2, 0.03) == "offload overhead +25.2% (spread 3.0%); target <= 5%: missed"
    assert overhead_line(100.0, 101.0, 0.02) == "offload overhead below the noise (spread 2.0%); target <= 5%: met"
    # the "-46.6% (met)": offload cannot be faster than keeping the cache; the noise made it so
    assert overhead_line(100.0, 53.4, 0.10) == "offload overhead none measured (spread 10.0%); target <= 5%: met"
    assert overhead_line(100.0, 53.4, 0.60).endswith("below the noise (spread 60.0%); target <= 5%: inconclusive "
                                                     "(noise)")
    assert overhead_line(100.0, 104.0, 0.03).endswith("+4.0% (spread 3.0%); target <= 5%: inconclusive (noise)")
    assert overhead_line(100.0, 104.0, None) == "offload overhead +4.0% (one round); target <= 5%: inconclusive (noise)"


def test_the_copy_time_hidden_is_a_figure_only_where_the_copies_time_is_beyond_the_spread():
    # the copies are 1% of a prefill on a host whose rounds spread 5%: the share is the noise's (it flapped 0 / 100%)
    said = hidden_line(100.0, 101.0, 100.2, 0.05)
    assert said.startswith("copy time hidden by the stream: inconclusive (noise): the copies' time (offload sync over "
                           "keep) is below the noise (the rounds' spread is 5.0%")
    assert hidden_line(100.0, 101.0, 100.2, None).startswith("copy time hidden by the stream: inconclusive (noise): ")
    # the copies 30% of a prefill with a 2% spread: 20 of the 30 ms hidden, +- 2.6 ms of 30
    said = hidden_line(100.0, 130.0, 110.0, 0.02)
    assert said.startswith("copy time hidden by the stream: 67% +- 9% (the rounds' spread over the copies' time; on "
                           "the main stream the copies add +30.0% to a prefill)"), said
    assert hidden_line(100.0, 130.0, 135.0, 0.02).startswith("copy time hidden by the stream: 0% +- ")  # bounded


def _figures(replayed, loop, timeline, spread):
    return {"first": 10.0, "replayed": replayed, "timeline": timeline, "loop": loop, "launches": 12,
            "spread": {k: spread for k in ("first", "replayed", "timeline", "loop")}}


def test_the_executors_differences_and_targets_are_judged_against_the_noise():
    d, noise = difference(_figures(1.6, 0.9, 6.5, 0.05), "replayed", "loop")
    assert d == 1.6 - 0.9 and noise == 0.05 * 1.6
    assert difference(_figures(1.6, 0.9, 6.5, None), "replayed", "loop")[1] is None
    figures = {"serial": _figures(1.6, 0.9, 6.5, 0.05), "two-batch": _figures(2.4, 0.7, 7.8, 0.05)}
    assert targets(figures) == [
        "target: a replayed launch at most 3 us above the loop in serial: met (0.70 us +- 0.08)",
        "target: a replayed launch at most 5 us above the loop in two-batch: met (1.70 us +- 0.12)",
        "target: a Timeline at most 10 us more per launch, every mode: met (largest in two-batch: 5.40 us +- 0.39)"]
    # the reference decoder's noise: a replayed launch 1336 us below its own timeline is none measured, not a figure
    noisy = {"serial": _figures(1500.0, 1200.0, 163.15, 0.3), "two-batch": _figures(2.4, 0.7, 13.0, 0.05)}
    said = targets(noisy)
    assert said[0] == "target: a replayed launch at most 3 us above the loop in serial: inconclusive (noise) (below " \
                      "the noise)"
    assert said[2] == "target: a Timeline at most 10 us more per launch, every mode: inconclusive (noise) (largest " \
                      "in two-batch: 10.60 us +- 0.65)"
    assert targets({"serial": _figures(1500.0, 1200.0, 163.15, 0.3)})[1] == (
        "target: a Timeline at most 10 us more per launch, every mode: met (largest in serial: none measured)")
    assert targets({"serial": _figures(20.0, 1.0, 25.0, 0.01)})[0].endswith(": missed (19.00 us +- 0.20)")


def test_a_share_outside_the_executor_is_a_figure_only_beyond_the_noise():
    assert outside_line("tiny", 2.64, 0.021, 0.005) == (
        "serial prefill of 64 tokens (tiny): 2.64 ms; the share outside the executor's launches (split, merge, "
        "embedding, final norm, the layers' operations): 2.1% (noise 0.5%); target at most 5%: met")
    assert outside_line("tiny", 7.93, -9.764, 0.3).endswith("operations): none measured (noise 30.0%); target at most "
                                                            "5%: met")
    assert outside_line("tiny", 7.93, 0.03, 0.3).endswith("operations): below the noise (noise 30.0%); target at most "
                                                          "5%: inconclusive (noise)")
    assert outside_line("tiny", 7.93, -9.764, None).endswith("operations): none measured; target at most 5%: "
                                                             "inconclusive (noise)")
