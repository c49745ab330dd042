"""`overlap.agreement`: every rank's values, or the same error on every rank (docs/architecture.md)."""
import math

import pytest
import torch
import torch.distributed as dist

from overlap import agreement
from overlap.agreement import Disagreement, GroupTransport, StoreTransport, agree, compare_posts
from overlap.multirank import run_ranks


def _post(problems=(), **values):
    return {"values": values, "problems": list(problems)}


def _message(posts, **kwargs):
    with pytest.raises(Exception) as info:
        compare_posts(posts, **kwargs)
    return str(info.value)


class _Posted:
    """A transport whose other ranks have posted already: ``posts`` with this rank's post put in at ``rank``."""

    def __init__(self, posts, rank):
        self.posts, self.rank = posts, rank

    def exchange(self, post, error):
        return [post if r == self.rank else p for r, p in enumerate(self.posts)]


# --- the message -----------------------------------------------------------------------------------------------

def test_a_value_that_differs_is_named_with_each_ranks_value():
    two = [_post(num_experts=8), _post(num_experts=4)]
    assert _message(two) == "ranks disagree on num_experts: rank 0: 8; rank 1: 4"
    # ranks that hold one value are named together, spans of three or more as a range
    four = [_post(k=2), _post(k=2), _post(k=1), _post(k=2)]
    assert _message(four) == "ranks disagree on k: ranks 0, 1, 3: 2; rank 2: 1"
    five = [_post(k=2)] * 3 + [_post(k=3), _post(k=2)]
    assert _message(five) == "ranks disagree on k: ranks 0-2, 4: 2; rank 3: 3"
    # strings and lists as Python writes them, a hint after the values
    assert _message([_post(mode=["serial"]), _post(mode="all")], hints={"mode": "pass one --mode"}) == \
        "ranks disagree on mode: rank 0: ['serial']; rank 1: 'all'; pass one --mode"


def test_problems_come_first_then_every_difference_one_line_each():
    posts = [_post(["out of memory"], seed=0, k=2), _post(["out of memory", "no disk"], seed=1, k=1)]
    assert _message(posts) == ("the ranks cannot go on together:\n"
                               "  ranks 0, 1: out of memory\n"
                               "  rank 1: no disk\n"
                               "  ranks disagree on seed: rank 0: 0; rank 1: 1\n"
                               "  ranks disagree on k: rank 0: 2; rank 1: 1")
    assert _message([_post(["out of memory"]), _post()]) == "rank 0: out of memory"


def test_values_that_agree_pass_and_per_rank_values_are_not_compared():
    compare_posts([_post(a=1, b=[1, 2]), _post(a=1.0, b=[1, 2])])  # 1 == 1.0
    compare_posts([_post(a=1, tokens=5), _post(a=1, tokens=7)], per_rank=("tokens",))
    # a name a rank does not post (it rejected its input before it knew it) is compared between the others
    assert _message([_post(capacity=4), _post(["bad input"]), _post(capacity=4)]) == "rank 1: bad input"
    # a rank without a problem posts every name
    assert _message([_post(capacity=4), _post()]) == "ranks disagree on capacity: rank 0: 4; rank 1: nothing"


def test_nan_equals_nan_and_differs_from_a_number():
    nan = float("nan")
    compare_posts([_post(x=nan, y=[1.0, nan]), _post(x=nan, y=[1.0, nan])])
    assert _message([_post(x=nan), _post(x=1.0)]) == "ranks disagree on x: rank 0: nan; rank 1: 1.0"
    assert _message([_post(x=math.inf), _post(x=-math.inf)]) == "ranks disagree on x: rank 0: inf; rank 1: -inf"
    assert _message([_post(y=[nan]), _post(y=[0.0])]) == "ranks disagree on y: rank 0: [nan]; rank 1: [0.0]"


# --- every rank raises alike ------------------------------------------------------------------------------------

class _Mismatch(KeyError):
    """A place's own error class: every rank raises it (a KeyError keeps its message in args[0])."""


def _outcomes(posts, own_errors=None, **kwargs):
    """What each rank of ``posts`` gets from `agree`: ``(type, message)`` or its returned values."""
    out = []
    for rank, post in enumerate(posts):
        own = (own_errors or {}).get(rank)
        try:
            out.append(agree(post["values"], _Posted(posts, rank), problems=post["problems"], own_error=own,
                             **kwargs))
        except Exception as err:  # noqa: BLE001 - what each rank raises is the point
            out.append((type(err), err.args[0]))
    return out


def test_every_rank_raises_the_same_error_of_the_class_asked_for():
    posts = [_post(n=8), _post(["its disk is full"], n=8), _post(n=4)]
    outcomes = _outcomes(posts, error=_Mismatch)
    assert len(set(outcomes)) == 1, outcomes
    kind, message = outcomes[0]
    assert kind is _Mismatch and message == ("the ranks cannot go on together:\n  rank 1: its disk is full\n"
                                             "  ranks disagree on n: ranks 0, 1: 8; rank 2: 4")
    assert set(_outcomes([_post(n=8), _post(n=4)])) == {(Disagreement, "ranks disagree on n: rank 0: 8; rank 1: 4")}
    assert issubclass(Disagreement, ValueError)


def test_a_rank_with_its_own_error_raises_it_and_the_others_name_it():
    own = TypeError("topk_idx holds expert 99")
    posts = [_post(n=8), _post(["TypeError: topk_idx holds expert 99"], n=8)]
    outcomes = _outcomes(posts, {1: own}, error=_Mismatch)
    assert outcomes[0] == (_Mismatch, "rank 1: TypeError: topk_idx holds expert 99")
    assert outcomes[1] == (TypeError, "topk_idx holds expert 99")
    # its words, when given, say it in context
    seen = []

    class Recording(_Posted):
        def exchange(self, post, error):
            seen.append(post)
            return super().exchange(post, error)

    with pytest.raises(TypeError):
        agree({}, Recording([_post(), _post()], 1), problems=["could not plan its batch: x"], own_error=own)
    assert seen[0]["problems"] == ["could not plan its batch: x"]


def test_agreeing_ranks_get_every_ranks_values_in_rank_order():
    posts = [_post(n=8, tokens=3), _post(n=8, tokens=float("nan"))]
    for got in _outcomes(posts, per_rank=("tokens",)):
        assert [v["n"] for v in got] == [8, 8] and got[0]["tokens"] == 3 and math.isnan(got[1]["tokens"])


# --- the transports ---------------------------------------------------------------------------------------------

def test_a_groups_post_has_one_size_whatever_a_rank_posts():
    small = agreement._fitted(_post(n=8), agreement._BYTES)
    huge_post = _post(["p" * 5000] * 9, a="x" * 9000, b=list(range(3000)), n=8)
    huge = agreement._fitted(huge_post, agreement._BYTES)
    assert len(huge) <= agreement._BYTES and len(agreement._packed(huge)) == len(agreement._packed(small))
    assert agreement._unpacked(agreement._packed(huge)) == huge
    # a long value becomes a digest that still compares: equal values alike, different ones not
    import json
    a, b = json.loads(huge)["values"]["a"], json.loads(agreement._fitted(_post(["q" * 5000] * 9, a="x" * 9000,
                                                                               b=[], n=8), agreement._BYTES))
    assert a == b["values"]["a"] and json.loads(huge)["values"]["n"] == 8
    too_many = _post(**{f"name {i}": i for i in range(400)})
    assert "does not fit" in json.loads(agreement._fitted(too_many, agreement._BYTES))["problems"][0]
    # NaN, inf and any text travel exactly; what JSON cannot hold travels as its str
    odd = _post(["ü ✓"], x=float("nan"), y=-math.inf, dtype=torch.bfloat16)
    back = json.loads(agreement._unpacked(agreement._packed(agreement._fitted(odd, agreement._BYTES))))
    assert math.isnan(back["values"]["x"]) and back["values"]["y"] == -math.inf
    assert back["values"]["dtype"] == "torch.bfloat16" and back["problems"] == ["ü ✓"]


def test_a_group_of_one_agrees_locally():
    assert not dist.is_initialized()
    assert agree({"n": (1, 2)}, GroupTransport(None, "t")) == [{"n": [1, 2]}]  # as JSON gives it back
    with pytest.raises(Disagreement, match="rank 0: no disk"):
        agree({}, GroupTransport(None, "t"), problems=["no disk"])


def test_the_store_names_the_ranks_that_did_not_post_in_time():
    store = dist.HashStore()
    late = StoreTransport(store, "job/start", 0, 3, 0.2, "reach the start of the job within --timeout 0.2 s")
    store.set("job/start/2", agreement._dumps(_post(n=8)))
    with pytest.raises(_Mismatch, match="rank 1 did not reach the start of the job within --timeout 0.2 s"):
        agree({"n": 8}, late, error=_Mismatch)
    store.set("job/start/1", agreement._dumps(_post(n=4)))
    with pytest.raises(_Mismatch, match="ranks disagree on n: ranks 0, 2: 8; rank 1: 4"):
        agree({"n": 8}, StoreTransport(store, "job/start", 0, 3, 0.2, "start"), error=_Mismatch)


def _group_body(ctx):
    out = []
    cases = [  # per case: (this rank's values, its problems)
        ({"n": 8, "long": "x" * (10 + 20000 * ctx.rank)}, []),  # 10 characters on rank 0, 20010 on rank 1
        ({"n": 8 - 4 * ctx.rank}, []),
        ({"n": 8}, ["no disk: " + "y" * 3000] if ctx.rank == 1 else []),
        ({"n": 8, "tokens": [3, float("nan")][ctx.rank]}, []),
    ]
    for values, problems in cases:
        try:
            got = agree(values, GroupTransport(ctx.group, "test.agree"), problems=problems, per_rank=("tokens",))
            out.append(repr(got))
        except Disagreement as err:
            out.append(f"Disagreement: {err}")
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)  # the group is still usable
    return out, t.item()


def test_ranks_that_post_different_sizes_over_a_group_raise_alike_without_a_hang_or_an_abort():
    (out0, s0), (out1, s1) = run_ranks(_group_body, 2, timeout=60)
    assert out0 == out1 and s0 == s1 == 2.0, (out0, out1)
    long, differ, problem, gathered = out0
    assert long.startswith("Disagreement: ranks disagree on long: rank 0: 'xxxxxxxxxx'; rank 1: '<20012 bytes of "
                           "JSON, crc32 "), long
    assert differ == "Disagreement: ranks disagree on n: rank 0: 8; rank 1: 4"
    assert problem.startswith("Disagreement: rank 1: no disk: yyy") and problem.endswith("...")
    assert gathered == repr([{"n": 8, "tokens": 3}, {"n": 8, "tokens": float("nan")}])


class _SlowReader:
    """A store whose reads take a while (a rank far behind in reading the posts)."""

    def __init__(self, store, delay):
        self.store, self.delay = store, delay

    def get(self, key):
        import time

        time.sleep(self.delay)
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_rank_0_leaves_an_agreement_only_once_every_rank_has_read_the_posts():
    """With ranks started by hand rank 0's process holds the store: leaving right after its own reading (on a
    disagreement every rank finds) cut a slower rank's reading short, which then failed with "Connection reset
    by peer" (exit 1) instead of the agreement's message (exit 2); CI saw it once."""
    import threading
    import time

    store = dist.HashStore()
    done = {}

    def rank(r, s):
        posts = StoreTransport(s, "job/start", r, 2, 10.0, "start").exchange(_post(seed=r), _Mismatch)
        done[r] = time.monotonic()
        assert [p["values"]["seed"] for p in posts] == [0, 1]

    slow = threading.Thread(target=rank, args=(1, _SlowReader(store, 0.2)))
    slow.start()
    rank(0, store)
    slow.join(10)
    assert done[0] >= done[1] - 0.05, done  # rank 0 returned after rank 1 had read (its count, then its return)


class _Problem(RuntimeError):
    pass


def test_a_problem_raises_its_own_error_where_one_is_given():
    posts = [_post(n=1), _post(["NaN in the logits"], n=2)]
    with pytest.raises(_Problem, match="rank 1: NaN in the logits"):
        compare_posts(posts, error=_Mismatch, problem_error=_Problem)
    with pytest.raises(_Mismatch, match="ranks disagree on n"):  # no problem: the values' error
        compare_posts([_post(n=1), _post(n=2)], error=_Mismatch, problem_error=_Problem)
    with pytest.raises(_Mismatch, match="NaN in the logits"):  # none given: the one error
        compare_posts(posts, error=_Mismatch)
