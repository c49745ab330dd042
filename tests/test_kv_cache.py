"""The decode KV cache: prefill writes, decode appends, one batched attention equals each request's own."""
import pytest
import torch
import torch.nn.functional as F

from microbatch import KVCache, KVCacheError

H, D = 2, 8


def _reference(q, k, v):
    """One request, one query over all of its keys: plain attention."""
    return F.scaled_dot_product_attention(q[:, None], k.transpose(0, 1), v.transpose(0, 1)).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_the_slots_equals_each_requests_own(dtype):
    torch.manual_seed(0)
    layers, prompts = 2, [5, 1, 9]
    cache = KVCache(layers, 4, 16, (H, D), dtype=dtype)
    slots = cache.admit(len(prompts))
    history = {(li, s): [torch.randn(n, H, D, dtype=dtype), torch.randn(n, H, D, dtype=dtype)]
               for li in range(layers) for s, n in zip(slots, prompts)}
    prefill = cache.rows(slots, prompts)
    for li in range(layers):
        cache.write(li, prefill, torch.cat([history[li, s][0] for s in slots]),
                    torch.cat([history[li, s][1] for s in slots]))
    cache.advance(prefill)
    assert [cache.lengths[s] for s in slots] == prompts
    active = list(slots)
    for step in range(4):
        if step == 2:  # the second request finishes: its slot is freed, the others go on
            cache.release([active[1]])
            active = [active[0], active[2]]
        rows = cache.rows(active)  # one row per active request, once for every layer
        for li in range(layers):
            k, v, q = (torch.randn(len(active), H, D, dtype=dtype) for _ in range(3))
            cache.write(li, rows, k, v)
            for i, s in enumerate(active):
                history[li, s][0] = torch.cat([history[li, s][0], k[i:i + 1]])
                history[li, s][1] = torch.cat([history[li, s][1], v[i:i + 1]])
            got = cache.attend(li, rows, q)
            want = torch.stack([_reference(q[i], *history[li, s]) for i, s in enumerate(active)])
            torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
        cache.advance(rows)
    assert cache.active == sorted(active)


def test_a_freed_slot_serves_a_new_request_from_empty():
    cache = KVCache(1, 1, 4, (H, D))
    (s,) = cache.admit()
    prompt = cache.rows([s], [3])
    cache.write(0, prompt, torch.full((3, H, D), 9.0), torch.full((3, H, D), 9.0))
    cache.advance(prompt)
    cache.release([s])
    assert cache.admit() == [s] and cache.lengths[s] == 0
    k, v = torch.randn(1, H, D), torch.randn(1, H, D)
    step = cache.rows([s])
    cache.write(0, step, k, v)
    torch.testing.assert_close(cache.attend(0, step, torch.randn(1, H, D)), v)  # its one row, not the old nines


def test_what_does_not_fit_is_refused_by_name():
    cache = KVCache(1, 2, 4, (H, D))
    a, b = cache.admit(2)
    with pytest.raises(KVCacheError, match="1 requests do not fit: 0 of 2 slots are free"):
        cache.admit()
    with pytest.raises(KVCacheError, match="slot 1 holds 0 rows; 5 more exceed its room of 4"):
        cache.rows([b], [5])
    cache.release([b])
    with pytest.raises(KVCacheError, match="slot 1 is not in use"):
        cache.rows([b])
    with pytest.raises(KVCacheError, match="do not go together"):
        cache.write(0, cache.rows([a], [2]), torch.zeros(3, H, D), torch.zeros(3, H, D))
    with pytest.raises(KVCacheError, match="max_len must be an integer of at least 1, got 0"):
        KVCache(1, 1, 0, (H, D))


def test_decode_attention_copies_the_histories_not_the_whole_room():
    """A decode step reads each slot's rows up to the longest history, whatever the cache's ``max_len`` (the room
    for the longest prompt and every new token): copying the whole room made attention O(max_len) per step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Materialised(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:  # a new tensor
                self.elements += sum(t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,))
                                     if isinstance(t, torch.Tensor))
            return out

    max_len, prompt = 512, 3
    cache = KVCache(1, 4, max_len, (H, D))
    slots = cache.admit(3)
    prefill = cache.rows(slots, [prompt] * 3)
    cache.write(0, prefill, torch.randn(9, H, D), torch.randn(9, H, D))
    cache.advance(prefill)
    rows = cache.rows(slots)
    with Materialised() as seen:
        k, v = cache.history(0, rows)
    assert k.shape == v.shape == (3, prompt + 1, H, D)
    assert seen.elements <= 2 * 3 * (prompt + 1) * H * D, f"{seen.elements} elements copied for a history of " \
                                                            f"{prompt + 1} rows in a room of {max_len}"
