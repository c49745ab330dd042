"""Greedy decode with the device KV cache equals recomputing the whole sequence at every step."""
import torch

from launch.decode import greedy_generate
from launch.models import build_model, preset
from microbatch import Batch, SeqInfo


def _recomputed(model, prompts, new_tokens, stop_token=None):
    """The oracle: every step runs the model over prompt + tokens so far and takes the last token's argmax."""
    out = []
    for p in prompts:
        seq = list(p)
        gen = []
        while len(gen) < new_tokens:
            hidden = model(Batch(torch.tensor(seq), SeqInfo.from_lens([len(seq)])))
            t = int(model.logits(hidden[-1:]).argmax(-1))
            gen.append(t)
            seq.append(t)
            if t == stop_token:
                break
        out.append(gen)
    return out


def test_cached_decode_generates_the_tokens_of_recomputing_every_step():
    model = build_model(preset("tiny"), seed=3)  # dense and MoE layers
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab, (n,), generator=g).tolist() for n in (7, 1, 12)]
    want = _recomputed(model, prompts, 6)
    assert greedy_generate(model, prompts, 6) == want
    stop = want[0][2]  # request 0 stops at its third token; the others go on past it (or stop there too)
    got = greedy_generate(model, prompts, 6, stop_token=stop)
    assert got == _recomputed(model, prompts, 6, stop_token=stop) and len(got[0]) == 3


def _spread_body(ctx):
    from launch.runner import make_expert_parallel

    model = make_expert_parallel(build_model(preset("tiny"), seed=3), ctx.group)
    try:
        greedy_generate(model, [[1, 2, 3]], 2)
    except ValueError as err:
        return str(err)
    return "no error"


def test_experts_spread_over_ranks_are_refused_before_any_exchange():
    """A rank whose requests end first would leave the others waiting in an exchange: refused up front."""
    from overlap.multirank import run_ranks

    for message in run_ranks(_spread_body, 2, timeout=120):
        assert "spread over 2 ranks" in message, message
