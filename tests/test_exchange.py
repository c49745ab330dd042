"""One interface for every exchange (`collectives.exchange.Exchange`): each family's class implements it member by
member, and an exchange of a new kind, written here, plugs into `ExpertParallelMoE` as it is (no subclass), for its
stages and its decode stages, whole or in chunks."""
from __future__ import annotations

from typing import List

import pytest
import torch

import microbatch
from collectives import (DECODE_EXCHANGES, MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT, AllToAllExchange,
                         CapacityExchange, Exchange, ExpertLayer, ExpertParallelMoE, MC2Exchange, MoE, MoEConfig,
                         RoutedTokens, capacity_expert_parallel, decode_exchange_named, wrap_expert_parallel)
from support.protocols import Without, protocol_members, protocol_problems

CFG = MoEConfig(hidden=32, ffn=16, n_experts=8, top_k=2, n_shared=1)
TOL = dict(rtol=1e-5, atol=1e-5)


class _Combined:
    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


class _KeepEverything:
    """An exchange of a new kind: nothing travels (one rank), every (token, expert) pair is a row of its expert,
    sorted by expert; the combine adds each token's rows times their weights. Written with the public interface
    only: `RoutedTokens`, what `ExpertLayer` offers, the experts object."""

    name = "keep_everything"

    def __init__(self) -> None:
        self.calls: List[str] = []

    def two_step(self, layer: ExpertLayer) -> bool:
        return False

    def prepare(self, tokens: RoutedTokens, layer: ExpertLayer, *, ahead: bool = False) -> RoutedTokens:
        self.calls.append("prepare")
        layer.shapes.check(tokens, layer)
        return tokens

    def dispatch(self, prepared: RoutedTokens) -> tuple:
        self.calls.append("dispatch")
        order = torch.argsort(prepared.topk_idx.reshape(-1), stable=True)  # the pairs by expert
        return prepared, order

    def run_experts(self, handle: tuple, experts) -> tuple:
        self.calls.append("run_experts")
        tokens, order = handle
        k = tokens.topk_idx.shape[1]
        rows = tokens.x.repeat_interleave(k, 0).index_select(0, order)
        counts = torch.bincount(tokens.topk_idx.reshape(-1), minlength=experts.num_local).tolist()
        return experts(rows, counts), None

    def combine(self, expert_out: torch.Tensor, batch: None, handle: tuple) -> _Combined:
        self.calls.append("combine")
        tokens, order = handle
        k = tokens.topk_idx.shape[1]
        weights = tokens.topk_weights.reshape(-1).float().index_select(0, order)[:, None]
        terms = expert_out.float() * weights
        if tokens.active is not None:  # a padding row's pairs add an exact zero
            real = tokens.active.repeat_interleave(k).index_select(0, order)[:, None]
            terms = torch.where(real, terms, torch.zeros((), dtype=terms.dtype))
        out = torch.zeros(tokens.x.shape, dtype=torch.float32).index_add_(0, order // k, terms)
        return _Combined(out.to(tokens.x.dtype))


def _exchanges():
    return [AllToAllExchange(), CapacityExchange(), CapacityExchange(4, validate=False, expert_path="all"),
            CapacityExchange.for_decode(), MC2Exchange(AllToAllExchange()),
            MC2Exchange(CapacityExchange.for_decode(), auto=False, max_tokens_per_rank=8, validate=False),
            _KeepEverything()] + [decode_exchange_named(name) for name in DECODE_EXCHANGES]


@pytest.mark.parametrize("exchange", _exchanges(), ids=lambda e: f"{type(e).__name__}-{e.name}")
def test_every_exchange_implements_the_protocol_member_by_member(exchange):
    assert isinstance(exchange, Exchange)
    assert protocol_problems(exchange, Exchange) == []


@pytest.mark.parametrize("exchange", _exchanges(), ids=lambda e: f"{type(e).__name__}-{e.name}")
def test_the_check_fails_on_an_exchange_without_a_member(exchange):
    members = protocol_members(Exchange)
    assert set(members) == {"name", "two_step", "prepare", "dispatch", "run_experts", "combine"}
    for member in members:
        problems = protocol_problems(Without(exchange, member), Exchange)
        assert problems and all(member in p for p in problems), (member, problems)


def test_the_check_fails_on_a_member_that_takes_other_calls():
    class NoAhead(_KeepEverything):
        def prepare(self, tokens, layer):  # the layer's count stage passes ahead=True
            return tokens

    class NamedByMethod(_KeepEverything):
        def name(self):
            return "keep"

    assert protocol_problems(NoAhead(), Exchange) == ["NoAhead.prepare: takes no keyword 'ahead'"]
    assert protocol_problems(NamedByMethod(), Exchange) == [
        "NamedByMethod.name: a method, but Exchange has this data"]


def test_a_decode_exchange_is_named_by_the_word_that_chooses_it():
    """The launcher's ``--decode-exchange`` values are the exchanges' names, and the decode calibration's key reads
    the layer's decode exchange's name."""
    assert DECODE_EXCHANGES == ("capacity", "mc2", "auto")
    assert [decode_exchange_named(name).name for name in DECODE_EXCHANGES] == list(DECODE_EXCHANGES)
    assert ExpertParallelMoE.from_config(CFG).decode_exchange.name == "capacity"
    with pytest.raises(ValueError, match="decode_exchange must be one of"):
        decode_exchange_named("nccl")


def test_the_layer_offers_what_an_exchange_reads():
    torch.manual_seed(0)
    moe = MoE(CFG)
    layers = [ExpertParallelMoE.from_config(CFG), wrap_expert_parallel(moe), capacity_expert_parallel(moe)]
    for layer in layers:
        assert protocol_problems(layer, ExpertLayer) == [], type(layer)
    assert protocol_problems(Without(layers[0], "shapes"), ExpertLayer, "layer") == [
        "layer.shapes: missing (ExpertLayer has this data)"]
    assert {type(layer) for layer in layers} == {ExpertParallelMoE}  # one layer, whatever it exchanges through


def _pair(exchange=None, decode_exchange=None):
    """The default layer and the same weights over ``exchange`` / ``decode_exchange``."""
    torch.manual_seed(0)
    want = ExpertParallelMoE.from_config(CFG)
    torch.manual_seed(0)
    got = ExpertParallelMoE.from_config(CFG, exchange=exchange, decode_exchange=decode_exchange)
    return want, got


def test_a_new_exchange_plugs_into_the_layers_stages_without_a_subclass():
    keep = _KeepEverything()
    want, layer = _pair(exchange=keep)
    assert type(layer) is ExpertParallelMoE and layer.exchange is keep
    assert [s.name for s in layer.stages()] == ["gate", "dispatch", "shared_gate_up", "experts", "shared_act",
                                                "combine", "shared_down", "finalize"]  # no count stage of its own
    x = torch.randn(9, CFG.hidden)
    torch.testing.assert_close(layer(x), want(x), **TOL)
    assert keep.calls == ["prepare", "dispatch", "run_experts", "combine"]


def _step(ops, x, capacity, active=None):
    (out,) = microbatch.run(microbatch.schedule_for("shared", [ops], 1), [ops],
                            [{MOE_IN: x, MOE_CAPACITY: capacity, MOE_ACTIVE: active}], output=MOE_OUT)
    return out


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("make", [CapacityExchange.for_decode, lambda: decode_exchange_named("auto"), _KeepEverything],
                         ids=["capacity", "auto", "new_kind"])
def test_decode_stages_run_over_each_static_exchange_whole_or_in_chunks(make, chunks):
    """The layer's decode stages over its decode exchange, whatever it is (``auto`` on one rank: the capacity
    exchange), equal the layer's own forward on the real rows; a padding row reaches no expert (the shared
    experts' output alone)."""
    exchange = make()
    want, layer = _pair(decode_exchange=exchange)
    x = torch.randn(7, CFG.hidden)
    active = torch.arange(7) < 4
    ops = layer.decode_stages(chunks)
    assert sum(op.name.startswith("dispatch") for op in ops) == chunks
    torch.testing.assert_close(_step(ops, x, 8), want(x), **TOL)
    got = _step(ops, x, 8, active)
    torch.testing.assert_close(got[:4], want(x[:4]), **TOL)
    sh = layer.shared
    torch.testing.assert_close(got[4:], sh.down(sh.activation(sh.gate_up(x[4:])), x[4:]), **TOL)
    if isinstance(exchange, _KeepEverything):
        assert exchange.calls.count("dispatch") == exchange.calls.count("combine") == 2 * chunks
