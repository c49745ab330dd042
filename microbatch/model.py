"""What the toolkit needs of a model, as `typing.Protocol`s: the contract between a model and its runners.

Two models implement it: the reference decoder (`launch.models.reference.Model`) and the
transformers adapter (`launch.models.transformers.TransformersModel`);
``tests/test_model.py`` and ``tests/test_transformers_models.py`` check every member below on
both, name and signature. Its consumers are the forward through a schedule (`microbatch.forward`),
the runner and the launcher (`launch.engine`, `launch.measure`, `launch.prefill`, `launch.health`)
and planning (`microbatch.planning.prefill`: its calibration and its choice).

- `MoEModel`: the whole contract. Embedding (`embed_tokens`), the layers (``layers``, each a
  `Layer`, and as the executor's operations: `layer_operations`), the final norm (`norm`, and its
  module ``final_norm``), the LM head (`logits`), whether a request can be cut across
  micro-batches (``no_cut_reason``), the shapes (``cfg``, a `ModelShape`), the serial forward,
  and the MoE blocks to replace by their expert-parallel form (`moe_layers`, `replace_moe`).
- `ForwardModel`: the part of it `microbatch.forward.run_schedule` reads. The forward takes the
  layers' operations beside the model (the caller may have changed them: an expert-parallel MoE,
  a KV offload after attention), so of the model it needs only the embedding, the final norm and
  whether a request can be cut; a test can run a schedule with a model of these three alone.
- `Layer`, `MoELayer`: one decoder layer as operations, and a layer with a MoE block.
- `ModelShape`: what the launcher and planning read of a model's shapes (``model.cfg``).

Value names (``HIDDEN``, ``OUT``, ``SEQ``, ``PREFIX_KV``, ``K``, ``V``) are `microbatch.schedules`'
and `microbatch.batch`'s.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import nn

from .batch import Batch, SeqInfo
from .operations import Operation

KV = Tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class ModelShape(Protocol):
    """A model's shapes (``model.cfg``): what the launcher prints and sizes by, and planning keys its cache by.

    ``k_shape`` / ``v_shape`` are one token's cached key / value (``(kv_heads, head_dim)``, or a
    latent's shape); ``n_dense_layers`` counts the layers without a MoE block.
    """

    vocab: int
    hidden: int
    n_layers: int
    n_dense_layers: int
    n_experts: int
    top_k: int
    n_shared: int

    @property
    def k_shape(self) -> Tuple[int, ...]: ...

    @property
    def v_shape(self) -> Tuple[int, ...]: ...

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has a MoE block."""


@runtime_checkable
class Layer(Protocol):
    """One decoder layer: its operations for the executor, or run in order on the current stream.

    ``index`` is its place in the model, ``is_moe`` whether its feed-forward block is a MoE.
    """

    index: int
    is_moe: bool

    def operations(self) -> List[Operation]:
        """This layer as operations, from ``HIDDEN``, ``SEQ``, ``PREFIX_KV`` to ``OUT`` (and ``K``, ``V``)."""

    def run(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None, **meta: object
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The operations in order: ``(out, k, v)`` (``k``, ``v`` None on a layer without keys and values);
        ``meta`` labels the spans."""


@runtime_checkable
class MoELayer(Layer, Protocol):
    """A layer whose feed-forward block is a MoE (``moe``): the block `MoEModel.replace_moe` replaces."""

    moe: nn.Module


@runtime_checkable
class ForwardModel(Protocol):
    """What `microbatch.forward` reads of a model: the embedding before the layers, the final norm after,
    and whether a request can be cut across micro-batches.

    ``no_cut_reason`` is None when a cut request's later part can continue from the keys and values
    of its earlier parts, else why not (`microbatch.forward.cut_refusal`: a cut split is refused).
    """

    no_cut_reason: Optional[str]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [tokens, hidden] of token ids [tokens]."""

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output."""


@runtime_checkable
class MoEModel(ForwardModel, Protocol):
    """What the runner, the launcher and planning need of a model (see the module docstring).

    ``layers`` are its decoder layers in order; ``final_norm`` is the module `norm` applies (the
    launcher's fault injection poisons its weight); ``cfg`` its shapes.
    """

    cfg: ModelShape
    layers: Sequence[Layer]
    final_norm: nn.Module

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: logits [tokens, vocab] of final (normed) hidden states [tokens, hidden]."""

    def layer_operations(self) -> List[List[Operation]]:
        """Every layer's operations, for the executor."""

    def moe_layers(self) -> Iterator[MoELayer]:
        """The layers with a MoE block, in order."""

    def replace_moe(self, make: Callable[[MoELayer], nn.Module]) -> None:
        """Set each MoE layer's ``moe`` to ``make(layer)`` (its expert-parallel form, in place)."""

    def forward(self, batch: Batch, kv_sink: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None
                ) -> torch.Tensor:
        """Serial prefill of the whole batch: final hidden states [tokens, hidden]; ``kv_sink(layer, k, v)``
        receives every layer's keys and values."""

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Its weights (`torch.nn.Module.parameters`): planning reads their device and dtype."""


@runtime_checkable
class DecodeModel(MoEModel, Protocol):
    """A `MoEModel` that also decodes: its layers' operations for a decode step read ``HIDDEN`` (one new token
    per active request) and ``KV_STEP`` (`microbatch.KVStep`: where the step's keys and values go in the
    cache, and every request's history there) instead of ``SEQ`` and ``PREFIX_KV``.

    ``no_capture_reason`` is None when its decode step can be captured as a static graph (its attention goes
    through the step's ``attend``, `microbatch.kv_cache.StaticKVStep`), else why not, in one line: what a
    captured decoder (`launch.engine.GraphDecoder`) refuses it with.
    """

    no_capture_reason: Optional[str]

    def decode_layer_operations(self, chunks: int = 1) -> List[List[Operation]]:
        """Every layer's operations for a decode step, for the executor; an expert-parallel MoE's in its decode
        stages (no host sync, its micro-batch's ``moe_capacity`` rows per rank), the routed experts in
        ``chunks``."""


__all__ = ["KV", "DecodeModel", "ForwardModel", "Layer", "MoELayer", "MoEModel", "ModelShape"]
