"""Tools the tests use that are not tests themselves, each also runnable on its own.

- `npu_schema`: the static analyzer of the toolkit's torch_npu / torchair calls, checked against a torch_npu
  wheel's schemas (``python tests/tools/npu_schema.py [WHEEL]`` lists every call and its verdict);
- `npu_allow`: the toolkit's dynamic NPU call sites the analyzer cannot resolve alone, and what each stands for;
- `torchair_contract`: the torchair / npugraph_ex contract harness (torch_npu's own Python code, loaded from the
  wheel, to capture and check FX graphs on CPU).
"""
