"""Micro-batch split planning, slicing, and the agreement of every rank on split-or-serial."""
import itertools
import random

import pytest
import torch

import overlap
from microbatch.batch import SeqInfo
from microbatch.planning.split import agree_split, decide_split, propose_split
from microbatch.split import Split, merge_outputs, micro_batches, prefix_kv, prefix_sources, split_tokens
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
def test_a_split_matches_brute_force(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 5, 17, 64, 300]) for _ in range(rng.randint(1, 6))] + [rng.randint(2, 9)]
    rng.shuffle(lens)
    limit = rng.choice([0.0, 0.05, 0.1, 0.3])
    split = propose_split(lens, min_tokens=2, max_imbalance=limit)
    total = sum(lens)
    n0, n1 = split.token_counts
    assert not split.serial and n0 + n1 == total and n0 >= 1 and n1 >= 1
    best = _best_boundary_imbalance(lens)
    if best is not None and best <= limit:
        assert split.cut is None and split.imbalance == pytest.approx(best)
    else:  # cut (or land on a boundary) at the middle token
        assert abs(n0 - n1) <= 1
        if best is not None:
            assert split.imbalance < best
    s0, s1 = micro_batches(split)
    assert s0.num_tokens == n0 and s1.num_tokens == n1
    assert list(s0.seq_lens[:-1]) == lens[:len(s0.seq_lens) - 1]
    if split.cut is not None:
        r, offset = split.cut
        assert s0.seq_lens[-1] == offset and s1.seq_lens[0] == lens[r] - offset
        assert s1.prefix_lens == (offset,) + (0,) * (s1.num_requests - 1)
    else:
        assert s1.num_prefix_tokens == 0 and list(s0.seq_lens) + list(s1.seq_lens) == lens


def test_threshold_decides_between_boundary_and_cut():
    lens = [12, 8]  # best boundary leaves 20% imbalance
    loose = propose_split(lens, min_tokens=2, max_imbalance=0.25)
    assert loose.split_at == 12 and loose.cut is None and "boundary" in loose.reason
    tight = propose_split(lens, min_tokens=2, max_imbalance=0.1)
    assert tight.split_at == 10 and tight.cut == (0, 10) and "cut request 0" in tight.reason
    no_cut = propose_split(lens, min_tokens=2, max_imbalance=0.1, allow_cut=False)
    assert no_cut.serial and "disabled" in no_cut.reason


def test_one_long_request_is_cut_inside():
    split = propose_split([101], min_tokens=2)
    assert split.cut == (0, 51) and split.token_counts == (51, 50)
    s0, s1 = micro_batches(split)
    assert s0 == SeqInfo((51,)) and s1 == SeqInfo((50,), (51,))
    assert torch.equal(s1.positions(), torch.arange(51, 101))
    k = torch.randn(51, 2, 4)
    pk, pv = prefix_kv(split, k, k + 1)
    assert torch.equal(pk, k) and torch.equal(pv, k + 1)


@pytest.mark.parametrize("lens,words", [([1], "1 token"), ([0, 1, 0], "1 token"), ([], "0 tokens"),
                                        ([5, 5], "min_tokens=32")])
def test_small_batches_run_serially(lens, words):
    split = propose_split(lens)
    assert split.serial and words in split.reason and split.token_counts == (sum(lens), 0)
    with pytest.raises(ValueError, match="serial"):
        micro_batches(split)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="non-negative"):
        propose_split([3, -1])
    with pytest.raises(ValueError, match="max_imbalance"):
        propose_split([3, 3], max_imbalance=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        propose_split([3, 3], min_tokens=-1)
    with pytest.raises(TypeError, match="Split"):
        agree_split([3, 3])


def test_slicing_and_merging_round_trip():
    lens = [3, 0, 9, 4]
    split = propose_split(lens, min_tokens=2)
    x = torch.randn(sum(lens), 5)
    x0, x1 = split_tokens(split, x)
    assert (x0.shape[0], x1.shape[0]) == split.token_counts
    assert torch.equal(merge_outputs(split, x0, x1), x)
    with pytest.raises(ValueError, match="rows"):
        split_tokens(split, x[1:])
    with pytest.raises(ValueError, match="do not match"):
        merge_outputs(split, x1, x0[:-1])


def test_seq_info():
    seq = SeqInfo((2, 3), (4, 0))
    assert seq.cu_seqlens == (0, 2, 5) and seq.num_tokens == 5 and seq.num_prefix_tokens == 4
    assert seq.positions().tolist() == [4, 5, 0, 1, 2]
    assert seq.cu_seqlens_tensor().dtype == torch.int32
    with pytest.raises(ValueError, match="differ in length"):
        SeqInfo((2, 3), (1,))


def test_agree_without_process_group_keeps_the_split(caplog):
    split = propose_split([1])
    with caplog.at_level("INFO", logger="microbatch.planning.split"):
        assert agree_split(split) == split
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
            split = decide_split(per_rank[ctx.rank], ctx.group, min_tokens=8)
        finally:
            overlap.remove_observer(counter)
        out.append((split.serial, split.split_at, split.reason, counter.n))
    return out


def _check_agreement(cases, results):
    for c, per_rank in enumerate(cases):
        got = [r[c] for r in results]
        local = [propose_split(lens, min_tokens=8) for lens in per_rank]
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
    split = decide_split(lens, ctx.group, min_tokens=2, max_imbalance=0.1, allow_cut=False)
    return split.serial, split.reason


def test_ranks_agree_when_one_rank_cannot_split_without_a_cut():
    (s0, r0), (s1, r1) = run_ranks(_no_cut_body, 2, timeout=60)
    assert s0 and s1 and "disabled" in r0 and "rank 0 of 2 cannot split" in r1


def _one_rank_has_bad_input(ctx):
    from microbatch.planning.split import decide_split

    lens = [-3, 5] if ctx.rank == 1 else [20, 20]
    try:
        decide_split(lens, ctx.group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_rank_with_bad_input_stops_every_rank_instead_of_hanging():
    from overlap.multirank import run_ranks

    r0, r1 = run_ranks(_one_rank_has_bad_input, 2, timeout=60)
    # every rank names the rank and its reason; the rank with bad input raises its own error
    assert r0.startswith("rank 1: could not split its batch: ") and "non-negative" in r0, r0
    assert "non-negative" in r1 and not r1.startswith("rank"), r1


# ---- N micro-batches ----------------------------------------------------------------------------

def _best_boundaries_spread(lens, n):
    """The smallest (largest - smallest) part over every choice of n - 1 request boundaries, or None."""
    total = sum(lens)
    bounds = sorted({b for b in SeqInfo(lens).cu_seqlens if 0 < b < total})
    spreads = []
    for points in itertools.combinations(bounds, n - 1):
        edges = (0,) + points + (total,)
        counts = [b - a for a, b in zip(edges, edges[1:])]
        spreads.append(max(counts) - min(counts))
    return min(spreads, default=None)


def _check_parts(split):
    """The micro-batches tile the batch: a cut request's later piece has its earlier pieces as prefix."""
    parts = micro_batches(split)
    assert len(parts) == split.n_parts and tuple(p.num_tokens for p in parts) == split.token_counts
    whole = []  # the requests put back together from their pieces
    for i, part in enumerate(parts):
        assert part.prefix_lens[1:] == (0,) * (part.num_requests - 1)
        assert bool(part.prefix_lens[0]) == bool(prefix_sources(split, i))
        for j, n in enumerate(part.seq_lens):
            if j == 0 and part.prefix_lens[0]:
                assert whole[-1] == part.prefix_lens[0]
                whole[-1] += n
            else:
                whole.append(n)
    assert [n for n in whole if n] == [n for n in split.seq_lens if n]


@pytest.mark.parametrize("seed", range(30))
def test_n_parts_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.choice([3, 4])
    lens = [rng.choice([1, 2, 5, 17, 64, 300]) for _ in range(rng.randint(1, 8))] + [rng.randint(4, 9)]
    rng.shuffle(lens)
    limit = rng.choice([0.0, 0.1, 0.3, 0.6])
    split = propose_split(lens, n, min_tokens=2, max_imbalance=limit)
    total = sum(lens)
    counts = split.token_counts
    assert split.n_parts == n and len(split.points) == n - 1 and sum(counts) == total and min(counts) >= 1
    best = _best_boundaries_spread(lens, n)
    if best is not None and best / total <= limit:
        assert split.cut is None and max(counts) - min(counts) == best and "request boundaries" in split.reason
    else:  # even shares, cutting requests
        assert max(counts) - min(counts) <= 1
    _check_parts(split)
    x = torch.arange(total)
    assert torch.equal(merge_outputs(split, *split_tokens(split, x)), x)


def test_n_parts_at_boundaries_and_cut():
    even = propose_split([10, 10, 10], 3, min_tokens=2)
    assert even.points == (10, 20) and even.split_at == 10 and even.cut is None
    assert even.reason == "request boundaries: 10/10/10 tokens (imbalance 0.0%)"
    once = propose_split([24, 30, 16], 3, min_tokens=2)
    assert once.points == (24, 47) and once.cuts == ((1, 23),)
    assert once.reason.startswith("cut request 1 at token 23: 24/23/23 tokens (best request boundaries 24/30/16")
    assert micro_batches(once) == (SeqInfo((24,)), SeqInfo((23,)), SeqInfo((7, 16), (23, 0)))
    twice = propose_split([101], 3, min_tokens=2)
    assert twice.cuts == ((0, 34), (0, 68)) and twice.cut == (0, 34) and twice.token_counts == (34, 34, 33)
    assert twice.reason == "cut request 0 at token 34, request 0 at token 68: 34/34/33 tokens (no request boundary)"
    assert micro_batches(twice) == (SeqInfo((34,)), SeqInfo((34,), (34,)), SeqInfo((33,), (68,)))
    assert [prefix_sources(twice, i) for i in range(3)] == [(), (0,), (0, 1)]


def test_a_request_cut_twice_gets_its_rows_of_every_earlier_part_as_prefix():
    split = propose_split([5, 40, 3], 4, min_tokens=2)  # shares 12/12/12/12: request 1 spans all four parts
    assert split.cuts == ((1, 7), (1, 19), (1, 31))
    k = torch.randn(48, 2, 3)
    parts = split_tokens(split, k)
    for mb, want in ((1, k[5:12]), (2, k[5:24]), (3, k[5:36])):
        kv = [t for j in prefix_sources(split, mb) for t in (parts[j], parts[j] + 1)]
        pk, pv = prefix_kv(split, *kv, mb=mb)
        assert torch.equal(pk, want) and torch.equal(pv, want + 1)
    with pytest.raises(ValueError, match=r"micro-batches \[0, 1\]: pass their keys and values \(4 tensors\)"):
        prefix_kv(split, parts[0], parts[0], mb=2)
    with pytest.raises(ValueError, match="micro-batch 1 keys/values have 11/12 rows, expected 12"):
        prefix_kv(split, parts[0], parts[0], parts[1][1:], parts[1], mb=2)
    assert prefix_kv(propose_split([10, 10, 10], 3, min_tokens=2), k[:10], k[:10], mb=1) is None


def test_too_few_tokens_for_n_parts_fall_back_to_fewer():
    two = propose_split([5, 5], 3, min_tokens=8)
    assert two.n_parts == 2 and two.split_at == 5
    assert two.reason == ("request boundary: 5/5 tokens (imbalance 0.0%); not 3 micro-batches: a batch of 10 tokens "
                          "is below 3 x min_tokens/2 = 12 for 3 micro-batches")
    three = propose_split([7, 7, 7, 4], 4, min_tokens=14)  # 25 tokens: enough for 3 parts of 7, not 4
    assert three.n_parts == 3 and "not 4 micro-batches" in three.reason and "4 x min_tokens/2 = 28" in three.reason
    assert [p.n_parts for p in three.fewer] == [2] and three.fewer[0] == propose_split([7, 7, 7, 4], min_tokens=14)
    assert propose_split([1, 1], 4, min_tokens=0).n_parts == 2  # one token per part at least
    assert "cannot be split into 3" in propose_split([1, 1], 3, min_tokens=0).reason
    for lens, words in (([1], "1 token"), ([5, 5], "min_tokens=32")):
        serial = propose_split(lens, 4)
        assert serial.serial and words in serial.reason and serial.fewer == ()


def test_without_cuts_n_parts_fall_back_to_fewer_balanced_boundaries():
    assert propose_split([10, 10, 10], 3, min_tokens=2, allow_cut=False).points == (10, 20)
    two = propose_split([12, 3, 15], 3, min_tokens=2, allow_cut=False)  # 12/3/15 is too unbalanced, 15/15 is not
    assert two.points == (15,) and "not 3 micro-batches: best request boundaries 12/3/15" in two.reason
    serial = propose_split([3, 17, 2], 3, min_tokens=2, allow_cut=False)
    assert serial.serial and "disabled" in serial.reason
    assert "only 1 request boundary for 3" in propose_split([20, 20], 3, min_tokens=2, allow_cut=False).reason


def test_two_part_splits_keep_their_api():
    split = Split((12, 8), 12, "given")
    assert split.points == (12,) and split.n_parts == 2 and split.token_counts == (12, 8) and split.edges == (0, 12, 20)
    serial = split.as_serial("no")
    assert serial.serial and serial.points == () and serial.n_parts == 1 and serial.token_counts == (20, 0)
    n_way = Split((30,), 10, "given", (10, 20))
    assert n_way.token_counts == (10, 10, 10) and n_way.imbalance == 0.0 and n_way.cuts == ((0, 10), (0, 20))
    with pytest.raises(ValueError, match="increase strictly"):
        Split((30,), 10, "bad", (10, 10))
    with pytest.raises(ValueError, match="increase strictly"):
        Split((30,), 5, "bad", (10, 20))
    with pytest.raises(ValueError, match="number of micro-batches"):
        propose_split([30], 1)
    with pytest.raises(ValueError, match="outputs of 10, 10 and 9 rows do not match the split's micro-batches of "
                                         "10, 10 and 10 tokens"):
        merge_outputs(n_way, torch.ones(10), torch.ones(10), torch.ones(9))


def _agree_n_body(ctx, cases):
    """Per case (n, allow_cut, per-rank seq_lens): this rank's (points, reason, collectives issued)."""
    out = []
    for n, allow_cut, per_rank in cases:
        counter = _CommCounter()
        overlap.add_observer(counter)
        try:
            split = decide_split(per_rank[ctx.rank], ctx.group, n=n, min_tokens=8, allow_cut=allow_cut)
        finally:
            overlap.remove_observer(counter)
        out.append((split.points, split.reason, counter.n))
    return out


def _check_n_agreement(cases, results, expected):
    for c, (n, allow_cut, per_rank) in enumerate(cases):
        got = [r[c] for r in results]
        local = [propose_split(lens, n, min_tokens=8, allow_cut=allow_cut) for lens in per_rank]
        offers = [{p.n_parts: p for p in (s,) + s.fewer if not s.serial and not p.serial} for s in local]
        common = set.intersection(*[set(o) for o in offers])
        assert [g[2] for g in got] == [1] * len(got), "exactly one collective per decision"
        assert len({len(g[0]) for g in got}) == 1, f"ranks disagree on the number of micro-batches: {got}"
        want = max(common, default=1)
        assert want == expected[c]
        for rank, (points, reason, _) in enumerate(got):
            if want == 1:
                assert points == ()
                continue
            assert points == offers[rank][want].points, (rank, got)
            planned = local[rank].n_parts
            if want < planned:
                assert f"{want} micro-batches, as rank" in reason and f"cannot split into {planned}" in reason
            else:
                assert reason == local[rank].reason
        if want == 1 and not any(p.serial for p in local):
            assert all("no number of micro-batches in common" in g[1] for g in got)


def test_ranks_agree_on_the_number_of_micro_batches():
    cases = [
        (3, True, [[40, 30], [200]]),             # both can take three
        (3, True, [[40, 30], [6, 5]]),            # rank 1 has tokens for two only: both take two
        (4, True, [[40, 30], [4]]),               # rank 1 cannot split: both serial
        (3, False, [[10, 10, 10], [10, 10]]),     # without cuts rank 0 can take only three, rank 1 only two
    ]
    _check_n_agreement(cases, run_ranks(_agree_n_body, 2, cases, timeout=60), [3, 2, 1, 1])
    four = [(4, True, [[64], [10, 20, 30], [5] * 8, [100, 3]]),   # 40 tokens on rank 2: four parts of 5
            (4, True, [[64], [10, 20, 30], [5] * 3, [100, 3]])]   # 15 tokens on rank 2: three parts, not four
    _check_n_agreement(four, run_ranks(_agree_n_body, 4, four, timeout=90), [4, 3])
