import os
import sys

import pytest

# Tests import the package from this checkout, whatever else is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.device import enter_test_device  # noqa: E402

enter_test_device()  # MEGATRON_LITE_TEST_DEVICE=cuda: the tests' tensors on the GPU (tests/device.py)


@pytest.fixture(scope="module", autouse=True)
def _shutdown_worker_pools():
    """Worker pools live for one test module: idle workers still hold the gloo threads of every
    engine they built, which wake up often enough to slow down the modules that follow."""
    yield
    from tests.harness import shutdown_pools

    shutdown_pools()


def _group(path: str) -> str:
    if path.startswith("tests/slurm/"):
        return "slurm"  # one two-node cluster, whose namespaces and daemons have fixed names
    if path.startswith("tests/checkpoint/") and path != "tests/checkpoint/test_import_hf.py":
        return "checkpoint"  # the session's training runs (tests/checkpoint/conftest.py), made once
    return path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh runs two workers, --dist loadgroup) a test file runs whole on one
    worker, so its module fixtures are built once; so do the files that share session fixtures. tryfirst:
    xdist reads the groups in its own hook."""
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(_group(path)))


def pytest_sessionfinish(session, exitstatus):
    """A test that leaves a process behind fails the run, and the process is killed: a lingering
    child (a data worker ignoring SIGTERM, once) otherwise keeps pytest, and CI, waiting forever.
    Under pytest-xdist each worker checks its own children; the controller's are the workers."""
    if getattr(session.config, "workerinput", None) is None and getattr(session.config.option, "numprocesses", None):
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
    """multiprocessing's own helper, which ends with the interpreter."""
    try:
        return "resource_tracker" in " ".join(process.cmdline())
    except Exception:  # noqa: BLE001 - gone already
        return True
