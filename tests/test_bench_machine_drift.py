"""benchmarks/bench_machine_drift.py times the same work round after round and says where a slow round's
time went (its numbers are for docs/benchmarks.md, not checked here)."""
import json
import subprocess
import sys

from tests.harness import REPO_ROOT


def test_the_drift_benchmark_prints_each_round_and_the_spread_and_writes_its_json(tmp_path):
    out = tmp_path / "drift.json"
    result = subprocess.run([sys.executable, "benchmarks/bench_machine_drift.py", "--rounds", "2", "--matmuls", "50",
                             "--processes", "1", "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("round ") >= 2 and "spread" in result.stdout
    written = json.loads(out.read_text())
    assert len(written["rounds"]) == 2 and written["summary"]["spread"] >= 1.0
    assert {"seconds", "user", "steal", "idle"} <= set(written["rounds"][0])


def test_a_round_count_of_zero_is_refused_naming_the_flag():
    result = subprocess.run([sys.executable, "benchmarks/bench_machine_drift.py", "--rounds", "0"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--rounds must be at least 1" in result.stderr
