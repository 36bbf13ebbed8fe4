import json
import os
import sys
from collections import defaultdict

import pytest

# Tests import the package from this checkout, whatever else is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import process_log  # noqa: E402
from tests.device import enter_test_device  # noqa: E402

process_log.install()  # TEST_PROCESS_LOG=FILE: every process a test starts (tests/process_log.py)
enter_test_device()  # MEGATRON_LITE_TEST_DEVICE=cuda: the tests' tensors on the GPU (tests/device.py)


@pytest.fixture(scope="module", autouse=True)
def _shutdown_worker_pools():
    """Worker pools live for one test module: idle workers still hold the gloo threads of every
    engine they built, which wake up often enough to slow down the modules that follow."""
    yield
    from tests.harness import shutdown_pools

    shutdown_pools()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """(data prefix, tokenizer model): 120 documents of Python's sources, a 400-piece SentencePiece model,
    made once per test run with the project's own tools (tests/artefacts.py) and shared by every worker."""
    from tests.artefacts import build_corpus, built_once

    root = built_once(tmp_path_factory, "corpus", build_corpus)
    return str(root / "corpus_text_document"), str(root / "spm.model")


def _group(path: str) -> str:
    if path.startswith("tests/slurm/"):
        return "slurm"  # one two-node cluster, whose namespaces and daemons have fixed names
    return path  # shared training runs are made once per run for every worker (tests/artefacts.py)


DURATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
"""Each test's seconds (setup + call + teardown) on the development VM, as the last run that timed it with
TEST_DURATIONS_OUT set recorded it (scripts/test.sh says how): the whole suite, then the fast tier, whose
tests take other times alone (a module's first test pays for starting its worker pool)."""
FAST_TIER_LIMIT_S = 1.0
"""A test recorded at this or more is left out of the fast tier, unless it is the quickest of its function's
parameter sets there (so every parity test keeps its smallest layout in the fast tier) and under
FAST_TIER_KEPT_LIMIT_S. The record holds only tests of a second or more: the fast tier is the rest. Measured on
the 2-core VM (2026-12-07, --fast's wall time): at 6 s 3 min 44 s, at 2 s 3 min 35 s (the record of a quiet VM
holds more tests under 2 s than one of a loaded VM), at 1.2 s 3 min 0 s; at 1 s with the kept limit below
2 min 38 s (2,947 tests), under the 3-minute target."""
FAST_TIER_KEPT_LIMIT_S = 5.0
"""A parity test's quickest layout recorded at this or more is left out too (the compiled layers' TP 2 x DP 2
layout, 13 s, MoE host syncs at EP 2, 8 s): the full suite runs them."""


def _recorded_seconds(path: str = DURATIONS_FILE) -> dict:
    try:
        with open(path) as f:
            return json.load(f)["seconds"]
    except FileNotFoundError:
        return {}


def mark_slow_by_record(items, seconds: dict, limit: float = FAST_TIER_LIMIT_S,
                        kept_limit: float = FAST_TIER_KEPT_LIMIT_S) -> None:
    """Mark slow what took `limit` seconds or more when last recorded, but the quickest not-yet-slow
    parameter set of each test function when under `kept_limit`. A test never recorded (a new one) stays in
    the fast tier."""
    by_function = defaultdict(list)
    for item in items:
        by_function[item.nodeid.split("[")[0]].append(item)
    for group in by_function.values():
        fast = [i for i in group if i.get_closest_marker("slow") is None]
        kept = min(fast, key=lambda i: seconds.get(i.nodeid, 0.0)) if len(group) > 1 and fast else None
        if kept is not None and seconds.get(kept.nodeid, 0.0) >= kept_limit:
            kept = None
        for item in fast:
            if item is not kept and seconds.get(item.nodeid, 0.0) >= limit:
                item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh runs two workers, --dist loadgroup) a test file runs whole on one
    worker, so its module fixtures are built once; so do the files that share session fixtures. tryfirst:
    xdist reads the groups in its own hook, and `-m "not slow"` deselects in pytest's own, after the
    recorded durations have marked the slow ones."""
    seconds = _recorded_seconds()
    mark_slow_by_record(items, seconds)
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(_group(path)))
    items[:] = longest_groups_first(items, seconds)


def longest_groups_first(items, seconds: dict) -> list:
    """The items with their groups in order of recorded seconds, longest first (each group's own order kept).
    pytest-xdist hands the groups out in this order to whichever worker is free: with the long ones (the
    Slurm tests, 3-4 minutes on one worker) last, one worker went on alone for a minute and a half after
    the other had finished; longest first leaves only short groups for the end."""
    totals = defaultdict(float)
    for item in items:
        totals[_group(item.nodeid.split("::")[0])] += seconds.get(item.nodeid, 0.0)
    return sorted(items, key=lambda item: -totals[_group(item.nodeid.split("::")[0])])  # stable


_durations = defaultdict(float)


def pytest_runtest_logreport(report):
    if os.environ.get("TEST_DURATIONS_OUT"):
        # xdist appends "@<group>" to the ids it reports; the record is keyed as collection sees them
        path = report.nodeid.split("::")[0]
        _durations[report.nodeid.removesuffix("@" + _group(path))] += report.duration


def _write_durations(path: str) -> None:
    """This run's durations over the recorded ones (a partial run updates only what it ran)."""
    from megatron_lite.atomic import write_text

    seconds = _recorded_seconds(path)
    seconds.update({k: round(v, 1) for k, v in _durations.items()})
    seconds = {k: v for k, v in sorted(seconds.items()) if v >= 1.0}  # the rest cannot reach the limit
    write_text(path, json.dumps({"seconds": seconds}, indent=0) + "\n")


def pytest_sessionfinish(session, exitstatus):
    """A test that leaves a process behind fails the run, and the process is killed: a lingering
    child (a data worker ignoring SIGTERM, once) otherwise keeps pytest, and CI, waiting forever.
    Under pytest-xdist each worker checks its own children; the controller's are the workers."""
    controller = getattr(session.config, "workerinput", None) is None
    if controller and os.environ.get("TEST_DURATIONS_OUT"):
        _write_durations(os.environ["TEST_DURATIONS_OUT"])
    if controller and getattr(session.config.option, "numprocesses", None):
        return
    import gc

    import psutil

    from tests.harness import shutdown_pools

    shutdown_pools()
    gc.collect()  # an unreachable DataLoader iterator stops its workers when collected
    left = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    left = psutil.wait_procs(left, timeout=10)[1]  # give those a moment to exit on their own
    if not left:
        return
    names = []
    for p in left:
        try:
            names.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    session.config.get_terminal_writer().line(
        "\nerror: tests left these processes running (killed now):\n  " + "\n  ".join(names), red=True)
    session.exitstatus = 1


def _is_resource_tracker(process) -> bool:
    """multiprocessing's own helpers (its resource tracker, the harness's fork server), which end with the
    interpreter."""
    try:
        command = " ".join(process.cmdline())
        return "resource_tracker" in command or "forkserver" in command
    except Exception:  # noqa: BLE001 - gone already
        return True
