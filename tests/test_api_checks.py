"""The generation API and its KV cache check their arguments as the launcher does: one line naming the argument and
its value (issue 57), before any collective; a valid call still generates."""
import pytest
import torch

import launch.engine
from launch.engine import generate, greedy_generate, new_cache
from launch.models import build_model, preset
from microbatch import KVCache, KVCacheError

H, D = 2, 8


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


def _cache(**kw):
    args = dict(n_layers=2, max_requests=3, max_len=8, k_shape=(H, D))
    args.update(kw)
    return KVCache(args.pop("n_layers"), args.pop("max_requests"), args.pop("max_len"), args.pop("k_shape"), **args)


@pytest.mark.parametrize("kw, message", [
    ({"n_layers": 2.5}, "n_layers must be an integer of at least 1, got 2.5"),
    ({"max_requests": True}, "max_requests must be an integer of at least 1, got True"),
    ({"max_len": float("nan")}, "max_len must be an integer of at least 1, got nan"),
    ({"max_len": 0}, "max_len must be an integer of at least 1, got 0"),
    ({"dtype": torch.int64}, "dtype must be a floating point torch.dtype, got torch.int64"),
    ({"k_shape": ()}, r"k_shape must be a non-empty sequence of positive integers \(one token's\), got \(\)"),
    ({"k_shape": (2, 0)}, r"k_shape\[1\] must be an integer of at least 1, got 0"),
    ({"v_shape": (2, 1.5)}, r"v_shape\[1\] must be an integer of at least 1, got 1.5"),
])
def test_a_cache_of_bad_sizes_or_dtype_is_refused_naming_the_argument(kw, message):
    with pytest.raises(KVCacheError, match=f"^{message}$"):
        _cache(**kw)


@pytest.mark.parametrize("n", [-1, -2, 1.5, True, "1"])
def test_admit_takes_a_count_not_a_slice(n):
    cache = _cache()
    with pytest.raises(KVCacheError, match=f"^n must be an integer of at least 0, got {n!r}$"):
        cache.admit(n)
    assert cache.admit(3) == [0, 1, 2]  # nothing was taken


def test_rows_refuse_a_negative_length():
    cache = _cache()
    slots = cache.admit(1)
    with pytest.raises(KVCacheError, match=r"^seq_lens\[0\] must be an integer of at least 0, got -2$"):
        cache.rows(slots, [-2])


@pytest.mark.parametrize("layer", [-1, 2, 5, True, 1.0])
def test_write_and_attend_take_a_layer_of_the_cache(layer):
    cache = _cache()
    rows = cache.rows(cache.admit(1), [1])
    k = torch.zeros(1, H, D)
    with pytest.raises(KVCacheError, match=rf"^layer must be an integer in \[0, 2\) \(the cache's layers\), "
                                           rf"got {layer!r}$"):
        cache.write(layer, rows, k, k)
    with pytest.raises(KVCacheError, match="^layer must be an integer"):
        cache.attend(layer, rows, k)
    assert cache.k.abs().sum() == 0  # the last layer was not written


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_keys_of_another_dtype_are_refused_rather_than_cast(dtype):
    cache = _cache()
    rows = cache.rows(cache.admit(1), [1])
    k = torch.ones(1, H, D, dtype=dtype)
    with pytest.raises(KVCacheError, match=f"^keys of dtype {dtype} do not go into a cache of torch.float32"):
        cache.write(0, rows, k, k)


def test_attend_refuses_queries_with_another_head_count():
    cache = _cache()
    rows = cache.rows(cache.admit(1), [1])
    cache.write(0, rows, torch.ones(1, H, D), torch.ones(1, H, D))
    with pytest.raises(KVCacheError, match=r"^queries \(1, 3, 8\) do not go with 1 slots of keys \(2, 8\)"):
        cache.attend(0, rows, torch.ones(1, 3, D))


@pytest.mark.parametrize("kw, message", [
    ({"new_tokens": 2.9}, "new_tokens must be an integer of at least 1 (or one per prompt), got 2.9"),
    ({"new_tokens": True}, "new_tokens must be an integer of at least 1 (or one per prompt), got True"),
    ({"new_tokens": [2, 1.5]}, "new_tokens must be an integer of at least 1 (or one per prompt), got [2, 1.5]"),
    ({"prompts": "hello"}, "prompts must be a list of prompts, each a list of token ids, got 'hello'"),
    ({"prompts": ["ab", [1]]}, "prompts[0] must be a list of token ids, got 'ab'"),
    ({"prompts": [[1, 1.7]]}, "prompts[0] holds 1.7: token ids are integers in [0, 128) (the vocabulary)"),
    ({"prompts": [[1], [500]]}, "prompts[1] holds 500: token ids are integers in [0, 128) (the vocabulary)"),
    ({"prompts": [[-1]]}, "prompts[0] holds -1: token ids are integers in [0, 128) (the vocabulary)"),
    ({"stop_token": 500}, "stop_token must be a token id in [0, 128) (the vocabulary) or None, got 500"),
    ({"stop_token": -1}, "stop_token must be a token id in [0, 128) (the vocabulary) or None, got -1"),
    ({"stop_token": "a"}, "stop_token must be a token id in [0, 128) (the vocabulary) or None, got 'a'"),
    ({"buckets": [0]}, "buckets must be positive row counts (integers of at least 1), got [0]"),
    ({"buckets": [-4]}, "buckets must be positive row counts (integers of at least 1), got [-4]"),
    ({"buckets": [1.5]}, "buckets must be positive row counts (integers of at least 1), got [1.5]"),
    ({"buckets": []}, "buckets must be positive row counts (integers of at least 1), got []"),
    ({"cache": "float16"}, "cache holds torch.float16, the model computes in torch.float32: make the cache of the "
                           "model's dtype (new_cache)"),
])
def test_generate_refuses_a_bad_argument_in_one_line_naming_it(model, monkeypatch, kw, message):
    args = {"prompts": [[1, 2, 3], [4]], "new_tokens": 2}
    args.update(kw)
    if args.get("cache") == "float16":
        args["cache"] = KVCache(model.cfg.n_layers, 2, 8, model.cfg.k_shape, model.cfg.v_shape, dtype=torch.float16)

    def no_decoders(*a, **k):
        raise AssertionError("the arguments are checked before any decoder is built or collective runs")

    monkeypatch.setattr("launch.engine.generation.make_decoders", no_decoders)
    prompts, new_tokens = args.pop("prompts"), args.pop("new_tokens")
    with pytest.raises(ValueError) as raised:
        generate(model, prompts, new_tokens, **args)
    assert str(raised.value) == message and "\n" not in message


def test_greedy_generate_checks_as_generate(model):
    with pytest.raises(ValueError, match=r"^new_tokens must be an integer of at least 1 \(or one per prompt\), "
                                         r"got 2.9$"):
        greedy_generate(model, [[1, 2]], 2.9)


def test_valid_arguments_still_generate(model):
    prompts = [[1, 2, 3], (4,)]
    want = greedy_generate(model, prompts, 3)
    stop = next(t for t in range(model.cfg.vocab) if all(t not in w for w in want))  # valid, never reached
    got = generate(model, prompts, [3, 3], stop_token=stop, buckets=(4, 1, 4), cache=new_cache(model, prompts, 3))
    assert got.tokens == want and [len(t) for t in want] == [3, 3]


def test_buckets_are_checked_once_sorted_and_without_repeats():
    assert launch.engine.checked_buckets([4, 1, 4]) == (1, 4) and launch.engine.checked_buckets(None) is None
