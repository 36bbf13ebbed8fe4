"""benchmarks/bench_planner.py's spread over rounds: how far apart the same layout measured in separate
rounds lies on this machine (the bound on any step-time prediction made at another time)."""
import json
import subprocess
import sys

from tests.harness import REPO_ROOT

sys.path.insert(0, REPO_ROOT)
from benchmarks.bench_planner import measured_spread  # noqa: E402


def _round(world: int, rows) -> dict:
    return {"worlds": [{"world": world, "rows": [
        {"name": name, "status": status, "ms_per_iteration": ms} for name, status, ms in rows]}]}


ROUNDS = [
    _round(2, [("004_tp1_cp1_pp1_dp2_mb2_none", "completed", 300.0), ("010_tp2_cp1_pp1_dp1_mb1_none", "completed", 900.0),
               ("011_tp1_cp1_pp2_dp1_mb1_none", "failed", None)]),
    _round(2, [("007_tp1_cp1_pp1_dp2_mb2_none", "completed", 240.0), ("003_tp1_cp1_pp2_dp1_mb1_none", "completed", 400.0)]),
]


def test_a_layout_measured_in_two_rounds_under_other_run_numbers_is_matched_and_its_spread_is_slowest_over_fastest():
    spread = measured_spread(ROUNDS)
    assert spread == [{"world": 2, "layout": "tp1_cp1_pp1_dp2_mb2_none", "ms_per_iteration": [300.0, 240.0],
                       "spread": 1.25}]


def test_spread_reads_earlier_json_files_and_measures_nothing(tmp_path):
    paths = []
    for i, r in enumerate(ROUNDS):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"model": [], "rounds": [r]}))
    result = subprocess.run([sys.executable, "benchmarks/bench_planner.py", "--spread", *map(str, paths)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tp1_cp1_pp1_dp2_mb2_none" in result.stdout and "spread 1.25" in result.stdout
    assert "median spread 1.25, largest 1.25, 0 of 1 over 1.25" in result.stdout


def test_spread_of_a_missing_or_foreign_file_is_refused_naming_the_flag_and_file(tmp_path):
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"runs": []}))
    for path in (tmp_path / "missing.json", foreign):
        result = subprocess.run([sys.executable, "benchmarks/bench_planner.py", "--spread", str(path)],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and f"--spread {path}: not a bench_planner --json file" in result.stderr, \
            result.stderr
