"""The KV cache's bookkeeping trusts no slot it is given: a slot named twice, a bool, a float or a string is refused
in one line, and nothing changes (issue 57: a slot released twice in one call was handed to two requests)."""
from __future__ import annotations

import pytest

from microbatch import KVCache, KVCacheError


def _cache(admitted: int = 2) -> KVCache:
    cache = KVCache(1, 3, 4, (1, 2))
    cache.admit(admitted)
    return cache


@pytest.mark.parametrize("call", ["release", "rows", "static_rows"])
@pytest.mark.parametrize("slots, words", [([0, 0], "slot 0 is named twice"), ([True], "got True"),
                                          ([0.0], "got 0.0"), (["0"], "got '0'"), ("0", "sequence of slot numbers"),
                                          (0, "sequence of slot numbers")])
def test_a_bad_slot_list_is_refused_in_one_line_and_changes_nothing(call, slots, words):
    cache = _cache()
    if call == "static_rows":
        cache.advance(cache.rows([0, 1]))  # a decode step follows the prefill
    before = (cache.active, list(cache.lengths))
    with pytest.raises(KVCacheError, match=words) as err:
        getattr(cache, call)(slots)
    assert "\n" not in str(err.value)
    assert (cache.active, list(cache.lengths)) == before


def test_a_slot_released_twice_in_one_call_is_never_handed_to_two_requests():
    cache = _cache()
    with pytest.raises(KVCacheError):
        cache.release([0, 0])
    cache.release([0])
    assert sorted(cache.admit(2)) == [0, 2]  # slot 0 once, and the third free slot


def test_slot_numbers_of_other_integer_types_are_taken_as_ints():
    cache = _cache()
    rows = cache.rows(tuple(s for s in (0, 1)))
    assert rows.slots == [0, 1] and all(type(s) is int for s in rows.slots)
    cache.release(range(2))
    assert cache.active == []
