"""The transformers config fields the toolkit reads: one list of each thing's names (`launch.models.transformers.
fields`), read through by every place that reads them (the launcher's checks, the adapter, the families' small
configs, the checkpoint loader, the memory estimate), so that a family that names its routed experts
``moe_num_experts`` (Aria) is known everywhere at once."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest
import torch

from launch.models.transformers import fields

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the lists a module outside fields.py must not spell again: each thing's names, one place
LISTED = set(fields.EXPERT_COUNTS + fields.TOP_K + fields.SHARED_COUNTS + fields.SHARED_SIZES + fields.MTP_LAYERS
             + fields.IDENTITY_EXPERTS)


def _aria(**values):
    """A config whose routed experts are ``moe_num_experts`` alone (and top-k ``moe_topk``), as Aria's are."""
    return transformers.AutoConfig.for_model("aria_text", **values)


def test_a_config_with_only_moe_num_experts_is_checked_in_one_line(tmp_path):
    """Its group routing is checked like DeepSeek's (it raised StopIteration: the check's own list of expert count
    fields left moe_num_experts out), naming the option, or the field of a checkpoint's config.json."""
    from launch.config import ConfigError, check_transformers_model, n_experts

    fits = _aria(moe_num_experts=8, moe_topk=2, n_group=2, topk_group=1)
    assert not any(hasattr(fits, f) for f in fields.EXPERT_COUNTS if f != "moe_num_experts")
    assert n_experts(fits) == 8
    check_transformers_model("aria_text", fits, torch.float32)
    uneven = _aria(moe_num_experts=6, moe_topk=2, n_group=4, topk_group=1)
    with pytest.raises(ConfigError) as err:
        check_transformers_model("aria_text", uneven, torch.float32)
    assert str(err.value) == ("--experts 6: aria_text routes within n_group=4 groups of experts, scoring each by its "
                              "best 2: the experts must be a multiple of 4, at least 8")
    folder = str(tmp_path)  # --model PATH: the field of its config.json is named
    with pytest.raises(ConfigError, match="^" + re.escape(f"moe_num_experts in {folder}/config.json 6: {folder} routes "
                                                          f"within n_group=4 groups")):
        check_transformers_model(folder, uneven, torch.float32)
    with pytest.raises(ConfigError, match=r"^--top-k must be between 1 and 4 \(the experts of the topk_group=1 of "
                                          r"n_group=2 groups it routes within\), got 5$"):
        check_transformers_model("aria_text", _aria(moe_num_experts=8, moe_topk=5, n_group=2, topk_group=1),
                                 torch.float32)


def test_every_reader_finds_the_same_counts():
    """The adapter's shapes, the launcher's expert count, the checkpoint loader's check and the families' overrides
    read a family's counts under the names it gives them."""
    from launch.config import n_experts
    from launch.models import CheckpointError, check_moe_config, from_config, small_config

    aria = _aria(moe_num_experts=6)
    assert (fields.expert_count(aria), fields.top_k(aria), fields.shared_count(aria)) == (6, aria.moe_topk, 2)
    assert n_experts(aria) == 6
    with pytest.raises(CheckpointError, match=r"^the config: moe_num_experts is 6, and 6 experts cannot be shared "
                                              r"equally by 4 ranks"):
        check_moe_config(aria, world=4)
    with pytest.raises(CheckpointError, match=r"^the config: moe_topk is 9, must be an integer in 1\.\.6"):
        check_moe_config(_aria(moe_num_experts=6, moe_topk=9))
    small = small_config("aria_text", dict(top_k=3, n_experts=4))
    assert (small.moe_num_experts, small.moe_topk) == (4, 3)  # the family's own fields, not another family's
    model = from_config(small_config("qwen2_moe", dict(n_experts=4, top_k=3)), seed=0)
    assert (model.cfg.n_experts, model.cfg.top_k, model.cfg.n_shared) == (4, 3, 1)  # a shared MLP's size: one


def _spelled_again(source, where):
    """The string constants of ``source`` (docstrings aside) that are one of the listed field names."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in LISTED
            and id(node) not in docstrings]


def test_no_module_lists_the_fields_again():
    """Outside fields.py, launch/ reads these fields through its lists: a fifth list of expert counts, differing
    from the others, cannot come back."""
    here = os.path.join(ROOT, "launch", "models", "transformers", "fields.py")
    found = [hit for file in sorted(glob.glob(os.path.join(ROOT, "launch", "**", "*.py"), recursive=True))
             if file != here for hit in _spelled_again(open(file, encoding="utf-8").read(),
                                                       os.path.relpath(file, ROOT))]
    assert found == []


def test_the_fields_check_can_fail():
    source = ('"""Reads n_routed_experts: a docstring may name it."""\n'
              'EXPERTS = ("n_routed_experts", "num_local_experts")\n'
              'def top_k(cfg):\n'
              '    """moe_topk too."""\n'
              '    return getattr(cfg, "moe_topk", None) or cfg.num_experts_per_tok\n')
    assert _spelled_again(source, "m.py") == ["m.py:2: 'n_routed_experts'", "m.py:2: 'num_local_experts'",
                                              "m.py:5: 'moe_topk'"]


def test_the_launchers_configuration_imports_no_transformers():
    """``import launch.config`` stays cheap: the options are checked before transformers is needed, and a job of
    the reference decoder never needs it."""
    code = "import sys, launch.config\nassert 'transformers' not in sys.modules, 'transformers imported'\n"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
