"""A pytest plugin (`-p benchmarks.gpu_check.immediate_failures`): each failing test's traceback is
appended to $MEGATRON_LITE_FAILURE_LOG the moment its report arrives. The GPU check runs pytest under a
time budget; a run killed at its budget never prints pytest's closing summary, and the first GPU
session of this round came back with 76 failures and not one traceback."""
from __future__ import annotations

import os

VARIABLE = "MEGATRON_LITE_FAILURE_LOG"
HEAD, TAIL = 15, 60  # lines of a long traceback kept: where it starts and where it raised


def shortened(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= HEAD + TAIL:
        return text
    return "\n".join(lines[:HEAD] + [f"... {len(lines) - HEAD - TAIL} lines ..."] + lines[-TAIL:])


_worker = False


def pytest_configure(config):
    # Under pytest-xdist the workers and the controller both see each report: the controller writes it. Asked of
    # this run's config, not of PYTEST_XDIST_WORKER, which a pytest started from inside a worker inherits.
    global _worker
    _worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    path = os.environ.get(VARIABLE)
    if not path or not report.failed or _worker:
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{shortened(report.longreprtext)}\n\n")
