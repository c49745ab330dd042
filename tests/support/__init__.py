"""Shared fakes and helpers of the test files (tests/test_*.py import them; no test file imports another).

- `ports`: free TCP ports per xdist worker, for tests that start torchrun;
- `protocols`: checks that a class implements a `typing.Protocol` member by member;
- `torchrun_mode`: the pytest plugin that runs the suite under torchrun (tests/conftest.py registers it);
- `example_runner`: runs a documentation example as a script, with the stream sanitizer on;
- `fake_npu`: a fake torch_npu holding the grouping operators, with the wheel's argument names;
- `launcher`: runs ``launch/prefill.py`` as users do (one process, torchrun, or ranks started by hand);
- `zygote`: Python processes forked from an interpreter that has imported torch (`subprocess`'s calls, cheaper);
- `layers`: toy MoE layers built from the overlap primitives;
- `spans`: what the toolkit's observers see (the names of the comm spans issued);
- `ranks`: rank bodies for `overlap.multirank.run_ranks` shared with the scripts tests generate.
"""
