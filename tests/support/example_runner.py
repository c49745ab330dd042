"""Run a documentation example as its user would, with the toolkit's stream sanitizer on.

``python tests/support/example_runner.py EXAMPLE.py [ARGS...]``, or the same under torchrun: starts the
sanitizer `overlap.sanitize_from_env` asks for (``OVERLAP_SANITIZE=raise``: the first race raises),
then runs EXAMPLE.py as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` that
``python EXAMPLE.py`` gives it. A multi-rank example (under torchrun) ends with `overlap.exit_rank`, which ends
the process: one that returns here instead fails, since the interpreter's teardown after it can abort a rank
that succeeded (docs/reliability.md, "Leaving"). The example itself holds no test plumbing
(tests/test_examples.py).
"""
from __future__ import annotations

import os
import runpy
import sys

NOT_LEFT = ("example_runner: a multi-rank example must end with overlap.exit_rank() (it returned instead, and the "
            "interpreter's teardown can abort a rank that succeeded)")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/support/example_runner.py EXAMPLE.py [ARGS...]")
    example = os.path.abspath(sys.argv[1])
    sys.argv = [example] + sys.argv[2:]
    sys.path[0] = os.path.dirname(example)  # as for `python EXAMPLE.py`: not this folder (tests/support/)
    import overlap

    overlap.sanitize_from_env()
    runpy.run_path(example, run_name="__main__")
    if "LOCAL_RANK" in os.environ:  # torchrun's rank
        raise SystemExit(NOT_LEFT)


if __name__ == "__main__":
    main()
