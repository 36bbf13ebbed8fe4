"""benchmarks/bench_context_parallel.py runs end to end on a tiny model and prints what its docstring promises
(its numbers are for the README, not checked here: timings on a shared VM are not test material)."""
import os
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.slow


def test_the_context_parallel_benchmark_prints_its_ratios_and_where_the_time_goes():
    result = subprocess.run([sys.executable, "benchmarks/bench_context_parallel.py", "--num-layers", "1", "--hidden-size",
                             "64", "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "128",
                             "--rounds", "1", "--steps", "1", "--profile"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            # the suite's PATH: DeepSpeed JIT-builds its shared-memory op with the first ninja on it,
                            # and another ninja (/usr/bin's 1.11 beside pip's 1.13) rebuilt it here and again in the
                            # next test's engine (about 60 s of CPU each time, measured)
                            env={"OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for line in ("cp2/dp2", "cp2/tp2", "cp2 all-to-alls:", "matmuls"):
        assert line in out, out
