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


def test_the_sweep_picks_context_parallel_layouts_in_proportion_and_always_the_layout_predicted_fastest():
    from types import SimpleNamespace

    from benchmarks.bench_planner import pick

    def candidate(rank, cp, saver):
        return SimpleNamespace(zero_stage=0, cpu_offload=False, context_parallel_size=cp, throughput_rank=rank,
                               saver=saver)

    # Shaden's order: the CP layouts last, the fastest (throughput rank 1) among them.
    plain = [candidate(r, 1, "none") for r in range(2, 10)]
    cp = [candidate(1, 2, "context parallel 2"), candidate(10, 2, "context parallel 2 + full recompute"),
          candidate(11, 2, "context parallel 2"), candidate(12, 2, "context parallel 2 + ZeRO 2")]
    chosen = pick(plain + cp, 6)
    assert len(chosen) == 6 and cp[0] in chosen and cp[3] not in chosen  # ZeRO 2 is not swept
    assert sum(c.context_parallel_size == 2 for c in chosen) == 2  # 3 of 11 swept candidates are CP: 2 of 6 runs
    assert pick(plain, 4) == [plain[0], plain[2], plain[5], plain[7]]  # spread over the predicted order


def test_runs_are_scored_together_and_apart_by_context_parallelism():
    from benchmarks.bench_planner import by_kind

    rows = [{"name": "a", "context_parallel_size": 1}, {"name": "b", "context_parallel_size": 2}, {"name": "c"}]
    assert by_kind(rows, lambda rs: [r["name"] for r in rs]) == {"all": ["a", "b", "c"], "no CP": ["a", "c"],
                                                                 "CP": ["b"]}
