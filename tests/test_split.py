"""Micro-batch split planning, slicing, and the agreement of every rank on split-or-serial."""
import random

import pytest
import torch

import overlap
from microbatch.split import (SeqInfo, SplitPlan, agree_split, decide_split, merge_outputs, micro_batches,
                              plan_split, prefix_kv, split_tokens)
from overlap.multirank import run_ranks


def _best_boundary_imbalance(lens):
    total, acc, best = sum(lens), 0, None
    for n in lens[:-1]:
        acc += n
        if 0 < acc < total:
            imb = abs(total - 2 * acc) / total
            best = imb if best is None else min(best, imb)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 5, 17, 64, 300]) for _ in range(rng.randint(1, 6))] + [rng.randint(2, 9)]
    rng.shuffle(lens)
    limit = rng.choice([0.0, 0.05, 0.1, 0.3])
    plan = plan_split(lens, min_tokens=2, max_imbalance=limit)
    total = sum(lens)
    n0, n1 = plan.token_counts
    assert not plan.serial and n0 + n1 == total and n0 >= 1 and n1 >= 1
    best = _best_boundary_imbalance(lens)
    if best is not None and best <= limit:
        assert plan.cut is None and plan.imbalance == pytest.approx(best)
    else:  # cut (or land on a boundary) at the middle token
        assert abs(n0 - n1) <= 1
        if best is not None:
            assert plan.imbalance < best
    s0, s1 = micro_batches(plan)
    assert s0.num_tokens == n0 and s1.num_tokens == n1
    assert list(s0.seq_lens[:-1]) == lens[:len(s0.seq_lens) - 1]
    if plan.cut is not None:
        r, offset = plan.cut
        assert s0.seq_lens[-1] == offset and s1.seq_lens[0] == lens[r] - offset
        assert s1.prefix_lens == (offset,) + (0,) * (s1.num_requests - 1)
    else:
        assert s1.num_prefix_tokens == 0 and list(s0.seq_lens) + list(s1.seq_lens) == lens


def test_threshold_decides_between_boundary_and_cut():
    lens = [12, 8]  # best boundary leaves 20% imbalance
    loose = plan_split(lens, min_tokens=2, max_imbalance=0.25)
    assert loose.split_at == 12 and loose.cut is None and "boundary" in loose.reason
    tight = plan_split(lens, min_tokens=2, max_imbalance=0.1)
    assert tight.split_at == 10 and tight.cut == (0, 10) and "cut request 0" in tight.reason
    no_cut = plan_split(lens, min_tokens=2, max_imbalance=0.1, allow_cut=False)
    assert no_cut.serial and "disabled" in no_cut.reason


def test_one_long_request_is_cut_inside():
    plan = plan_split([101], min_tokens=2)
    assert plan.cut == (0, 51) and plan.token_counts == (51, 50)
    s0, s1 = micro_batches(plan)
    assert s0 == SeqInfo((51,)) and s1 == SeqInfo((50,), (51,))
    assert torch.equal(s1.positions(), torch.arange(51, 101))
    k = torch.randn(51, 2, 4)
    pk, pv = prefix_kv(plan, k, k + 1)
    assert torch.equal(pk, k) and torch.equal(pv, k + 1)


@pytest.mark.parametrize("lens,words", [([1], "1 token"), ([0, 1, 0], "1 token"), ([], "0 tokens"),
                                        ([5, 5], "min_tokens=32")])
def test_small_batches_run_serially(lens, words):
    plan = plan_split(lens)
    assert plan.serial and words in plan.reason and plan.token_counts == (sum(lens), 0)
    with pytest.raises(ValueError, match="serial"):
        micro_batches(plan)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="non-negative"):
        plan_split([3, -1])
    with pytest.raises(ValueError, match="max_imbalance"):
        plan_split([3, 3], max_imbalance=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        plan_split([3, 3], min_tokens=-1)
    with pytest.raises(TypeError, match="SplitPlan"):
        agree_split([3, 3])


def test_slicing_and_merging_round_trip():
    lens = [3, 0, 9, 4]
    plan = plan_split(lens, min_tokens=2)
    x = torch.randn(sum(lens), 5)
    x0, x1 = split_tokens(plan, x)
    assert (x0.shape[0], x1.shape[0]) == plan.token_counts
    assert torch.equal(merge_outputs(plan, x0, x1), x)
    with pytest.raises(ValueError, match="rows"):
        split_tokens(plan, x[1:])
    with pytest.raises(ValueError, match="do not match"):
        merge_outputs(plan, x1, x0[:-1])


def test_seq_info():
    seq = SeqInfo((2, 3), (4, 0))
    assert seq.cu_seqlens == (0, 2, 5) and seq.num_tokens == 5 and seq.num_prefix_tokens == 4
    assert seq.positions().tolist() == [4, 5, 0, 1, 2]
    assert seq.cu_seqlens_tensor().dtype == torch.int32
    with pytest.raises(ValueError, match="differ in length"):
        SeqInfo((2, 3), (1,))


def test_agree_without_process_group_keeps_the_plan(caplog):
    plan = plan_split([1])
    with caplog.at_level("INFO", logger="microbatch.split"):
        assert agree_split(plan) == plan
    assert "1 token" in caplog.text


class _CommCounter:
    def __init__(self):
        self.n = 0

    def on_span_start(self, span):
        self.n += span.kind == "comm"


def _agree_body(ctx, cases):
    """Per case: this rank's seq_lens -> (serial, split_at, reason, collectives issued)."""
    out = []
    for per_rank in cases:
        counter = _CommCounter()
        overlap.add_observer(counter)
        try:
            plan = decide_split(per_rank[ctx.rank], ctx.group, min_tokens=8)
        finally:
            overlap.remove_observer(counter)
        out.append((plan.serial, plan.split_at, plan.reason, counter.n))
    return out


def _check_agreement(cases, results):
    for c, per_rank in enumerate(cases):
        got = [r[c] for r in results]
        local = [plan_split(lens, min_tokens=8) for lens in per_rank]
        assert [g[3] for g in got] == [1] * len(got), "exactly one collective per decision"
        assert len({g[0] for g in got}) == 1, f"ranks disagree: {got}"
        if any(p.serial for p in local):
            bad = [r for r, p in enumerate(local) if p.serial]
            for rank, (serial, split_at, reason, _) in enumerate(got):
                assert serial and split_at is None
                if rank in bad:
                    assert reason.startswith(local[rank].reason)
                else:
                    assert f"{bad[0]}" in reason and "cannot split" in reason
        else:
            assert [(g[1], g[2]) for g in got] == [(p.split_at, p.reason) for p in local]


def test_two_ranks_with_different_batches_agree():
    cases = [
        [[40, 30], [1]],            # rank 1 has one token: both run serially
        [[40, 30], [200]],          # both split, at their own points (rank 1 inside its request)
        [[3, 2], [16, 16]],         # rank 0 is below min_tokens
    ]
    _check_agreement(cases, run_ranks(_agree_body, 2, cases, timeout=60))


def test_four_ranks_with_different_batches_agree():
    cases = [
        [[64], [10, 20, 30], [5] * 8, [100, 3]],
        [[64], [10, 20, 30], [4], [100, 3]],
        [[1], [10, 20, 30], [5] * 8, []],
    ]
    _check_agreement(cases, run_ranks(_agree_body, 4, cases, timeout=90))


def test_without_cuts_a_batch_splits_at_a_boundary_or_runs_serially():
    boundary = decide_split([20, 21], None, min_tokens=2, allow_cut=False)
    assert boundary.split_at == 20 and boundary.cut is None
    serial = decide_split([41], None, min_tokens=2, allow_cut=False)
    assert serial.serial and "disabled" in serial.reason


def _no_cut_body(ctx):
    lens = [[12, 8], [10, 10]][ctx.rank]  # rank 0 would have to cut a request
    plan = decide_split(lens, ctx.group, min_tokens=2, max_imbalance=0.1, allow_cut=False)
    return plan.serial, plan.reason


def test_ranks_agree_when_one_rank_cannot_split_without_a_cut():
    (s0, r0), (s1, r1) = run_ranks(_no_cut_body, 2, timeout=60)
    assert s0 and s1 and "disabled" in r0 and "rank 0 of 2 cannot split" in r1


def _one_rank_has_bad_input(ctx):
    from microbatch.split import decide_split

    lens = [-3, 5] if ctx.rank == 1 else [20, 20]
    try:
        decide_split(lens, ctx.group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_rank_with_bad_input_stops_every_rank_instead_of_hanging():
    from overlap.multirank import run_ranks

    r0, r1 = run_ranks(_one_rank_has_bad_input, 2, timeout=60)
    assert "rank(s) [1] of 2 could not plan a split" in r0
    assert "non-negative" in r1
