"""A pytest plugin for the device scripts: each failure's test id and the end of its report appended to
``$FAILURE_LOG`` as it happens, so a run cut off by its time bound still says what failed and why.
Load it with ``PYTHONPATH=.ci pytest -p failure_log``."""
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # under xdist: the controller's copy
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{str(report.longrepr)[-2000:]}\n\n")
