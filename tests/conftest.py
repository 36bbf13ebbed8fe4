import os
import sys

import pytest

# Tests import the package from this checkout, whatever else is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worker_pools():
    yield
    from tests.harness import shutdown_pools

    shutdown_pools()
