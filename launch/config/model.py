"""The job's model: the reference decoder's shapes (its preset with the overrides), or the transformers config of
``--model NAME|PATH``, checked against what its model can run before any rank builds it.

``--model NAME`` is a transformers model type made small (`launch.models.small_config`) with the
overrides (``--layers``, ``--experts``, ...), which the adapter must run (`launch.models.check_family`);
``--model PATH`` a checkpoint folder, whose config and files are checked without reading a weight
(`launch.models.check_checkpoint`). The fields read are `launch.models.transformers.fields`'.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable, Dict, Optional, Union

import torch

from launch.models import (CheckpointError, ModelConfig, check_checkpoint, check_family, preset, small_config,
                           text_model_type)
from launch.models.common import one_line
from launch.models.transformers.fields import EXPERT_COUNTS, TOP_K, expert_count, held_field

from .errors import ConfigError

if TYPE_CHECKING:  # imported where it is used: only for --model NAME|PATH
    from transformers import PretrainedConfig

__all__ = ["ModelSettings", "OVERRIDE_OPTIONS", "Overrides", "REFERENCE", "build_model_config",
           "check_transformers_model", "check_transformers_overrides", "n_experts", "transformers_config"]

ModelSettings = Union[ModelConfig, "PretrainedConfig"]  # the reference's shapes, or a transformers config
Overrides = Dict[str, Optional[int]]  # --layers, --hidden, ... by ModelConfig field; None: not given

REFERENCE = "reference"  # --model: the toolkit's reference decoder
# the option of each override (a ModelConfig field, as launch.models' overrides name it)
OVERRIDE_OPTIONS = {"n_layers": "--layers", "n_dense_layers": "--dense-layers", "hidden": "--hidden",
                    "n_experts": "--experts", "top_k": "--top-k", "n_shared": "--shared-experts"}
_GROUPED_MM_BYTES = 16  # torch's grouped matmul (transformers' experts) takes rows of a multiple of 16 bytes


def build_model_config(preset_name: str, overrides: Overrides) -> ModelConfig:
    """The reference model's shapes: the preset with the options given; `ConfigError` naming a bad one."""
    try:
        return preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        hint = " (--dense-layers sets the leading dense layers)" if "n_dense_layers" in str(exc) else ""
        raise ConfigError(str(exc) + hint) from None


def transformers_config(model_name: str, overrides: Overrides, full_size: bool = False) -> PretrainedConfig:
    """The transformers config of ``--model NAME`` (small, with the overrides; ``full_size``: the family's published
    default config, as ``--dry-run`` sizes it) or ``--model PATH`` (as saved)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model {model_name} needs transformers: pip install 'npu-overlap[transformers]'") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    if os.path.isdir(model_name):
        if given:
            raise ConfigError(f"--model {model_name} is a checkpoint: its shapes are its own "
                              f"(drop {', '.join(OVERRIDE_OPTIONS.get(k, '--' + k) for k in given)})")
        if not os.path.isfile(os.path.join(model_name, "config.json")):
            raise ConfigError(f"--model {model_name}: a checkpoint folder needs a config.json")
        _refuse_wrapper_checkpoint(model_name)
        config = _saved_config(model_name, full_size)
        if full_size:  # --dry-run runs nothing, not even a small model of the family: the run itself checks that
            return config
        try:  # a family the adapter does not run is refused here, not halfway through the load
            check_family(config.model_type)
        except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
            raise ConfigError(f"--model {model_name}: a {config.model_type} checkpoint: "
                              f"{one_line(exc, limit=None)}") from None
        return config
    if model_name not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"--model {model_name}: neither 'reference', a folder, nor a transformers model type "
                          f"(e.g. qwen3_moe, deepseek_v3, mixtral, qwen2_moe, glm4_moe)")
    if full_size:
        return _published_config(model_name, given)
    try:  # the family must run through the adapter (a small model of it, on this rank alone): else one line
        config = small_config(model_name, given)
        check_family(model_name, given)
    except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
        raise ConfigError(f"--model {model_name}: {one_line(exc, limit=None)}") from None
    return config


def _saved_config(folder: str, config_only: bool) -> PretrainedConfig:
    """A checkpoint folder's config, with the headers of its files checked (what every rank finds alike, before any
    group); ``config_only`` (``--dry-run``, which reads no weight): its ``config.json`` alone."""
    if config_only:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(folder)
        except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
            raise ConfigError(f"--model {folder}/config.json: {one_line(exc, limit=None)}") from None
    try:
        return check_checkpoint(folder)
    except CheckpointError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None  # it names the folder or file


def _published_config(model_name: str, given: Overrides) -> PretrainedConfig:
    """The family's published default config (``AutoConfig.for_model``, nothing made small); the shape overrides are
    refused: it is sized as published. Whether the adapter runs the family is not tried (`check_family` runs a small
    model of it; ``--dry-run`` runs nothing): the run itself checks it."""
    from transformers import AutoConfig

    if given:
        raise ConfigError(f"--model {model_name} --dry-run sizes the family's published config: drop "
                          f"{', '.join(OVERRIDE_OPTIONS.get(k, '--' + k) for k in given)}")
    try:
        config = AutoConfig.for_model(model_name)
    except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
        raise ConfigError(f"--model {model_name}: {one_line(exc, limit=None)}") from None
    text = getattr(config, "text_config", None) if text_model_type(model_name) else None
    return text if text is not None else config  # a multimodal wrapper runs as its text model


def _refuse_wrapper_checkpoint(folder: str) -> None:
    """A checkpoint of a multimodal wrapper (its config.json's ``text_config`` holds the text model): a
    `ConfigError` naming what the loader lacks (its text model's weights out of the wrapper's files)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # check_checkpoint names what is wrong with it
    text = text_model_type(model_type) if isinstance(model_type, str) else None
    if text is not None:
        raise ConfigError(f"--model {folder}: a {model_type} checkpoint is a multimodal model: the loader does not "
                          f"take its text model's ({text}) weights out of it; --model {model_type} runs its text model "
                          f"with seeded weights, or save the text model as a {text} checkpoint of its own")


def n_experts(job_model: ModelSettings) -> int:
    """Routed experts per MoE layer of a model config (the reference's or a transformers one); 0 if none."""
    if hasattr(job_model, "n_experts"):
        return int(job_model.n_experts)
    return expert_count(job_model)


def check_transformers_model(model_name: str, cfg: PretrainedConfig, dtype: torch.dtype) -> None:
    """Routing, layer counts and sizes of the transformers config ``cfg`` that its model cannot run with,
    found before any rank builds it: a `ConfigError` naming the option (for a checkpoint, the field of its
    config.json) and the valid range, instead of an error from inside the model."""
    checkpoint = os.path.isdir(model_name)

    def name(option: str, field: str) -> str:
        return f"{field} in {model_name}/config.json" if checkpoint else f"--{option}"

    experts = n_experts(cfg)
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise ConfigError(f"{name('layers', 'num_hidden_layers')} must be >= 1, got {layers}")
    _check_dense_layers(cfg, layers, name)
    top_field = held_field(cfg, TOP_K)
    top_k = getattr(cfg, top_field) if top_field else None
    most = _check_groups(model_name, cfg, experts, name)
    if top_k is not None and not 1 <= top_k <= most:
        why = f"the {experts} experts" if most == experts else \
            f"the experts of the topk_group={cfg.topk_group} of n_group={cfg.n_group} groups it routes within"
        raise ConfigError(f"{name('top-k', top_field)} must be between 1 and {most} ({why}), got {top_k}")
    per_row = _GROUPED_MM_BYTES // torch.empty((), dtype=dtype).element_size()
    for option, field in (("hidden", "hidden_size"), ("", "moe_intermediate_size")):
        size = getattr(cfg, field, None)
        if isinstance(size, int) and size % per_row:
            what = name(option, field) if option or checkpoint else f"{model_name}'s {field}"
            raise ConfigError(f"{what} must be a multiple of {per_row} with {str(dtype).replace('torch.', '')}: "
                              f"{model_name}'s experts run torch's grouped matmul, which takes rows of a multiple of "
                              f"{_GROUPED_MM_BYTES} bytes; got {size}")


def check_transformers_overrides(model_name: str, overrides: Overrides, dtype: torch.dtype) -> None:
    """`check_transformers_model` on the small config of ``--model NAME`` with the overrides, before
    `transformers_config` builds and runs a model of it (whose failure would be the model's own words);
    nothing where that config cannot be made at all: `transformers_config` says why."""
    try:
        import transformers

        if model_name not in transformers.CONFIG_MAPPING:
            return
        cfg = small_config(model_name, {k: v for k, v in overrides.items() if v is not None})
    except Exception:  # noqa: BLE001 - reported by transformers_config, with its own words
        return
    check_transformers_model(model_name, cfg, dtype)


def _check_dense_layers(cfg: PretrainedConfig, layers: Optional[int], name: Callable[[str, str], str]) -> None:
    """The leading dense layers fit the layers (the reference model refuses more, so does this)."""
    if not isinstance(layers, int):
        return
    dense = getattr(cfg, "first_k_dense_replace", None)
    if isinstance(dense, int) and not 0 <= dense <= layers:
        raise ConfigError(f"{name('dense-layers', 'first_k_dense_replace')} must be between 0 and the {layers} "
                          f"layers ({name('layers', 'num_hidden_layers')}), got {dense}")
    only = getattr(cfg, "mlp_only_layers", None)
    if isinstance(only, (list, tuple)) and any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ConfigError(f"{name('dense-layers', 'mlp_only_layers')} must be between 0 and the {layers} layers "
                          f"({name('layers', 'num_hidden_layers')}), got {len(only)} dense layer(s): {list(only)}")


def _check_groups(model_name: str, cfg: PretrainedConfig, experts: int, name: Callable[[str, str], str]) -> int:
    """DeepSeek-style group routing (``n_group`` groups, the best ``topk_group`` of them, top-k within those):
    the experts must split into the groups, each holding enough to score it; the most top-k can pick."""
    groups, chosen = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    method = getattr(cfg, "topk_method", None)
    if not (isinstance(groups, int) and isinstance(chosen, int)) or method == "greedy" or experts < 1:
        return experts
    if groups < 1 or not 1 <= chosen <= groups:
        raise ConfigError(f"{model_name}: topk_group={chosen} must be between 1 and n_group={groups} (>= 1)")
    # a group's score: its best expert (DeepSeek-V2's group_limited_greedy), else the sum of its best two
    least = 1 if method == "group_limited_greedy" else 2
    if experts % groups or experts // groups < least:
        field = held_field(cfg, EXPERT_COUNTS)
        raise ConfigError(f"{name('experts', field)} {experts}: {model_name} routes within "
                          f"n_group={groups} groups of experts, scoring each by its best {least}: the experts must "
                          f"be a multiple of {groups}, at least {least * groups}")
    return min(experts, chosen * (experts // groups))
