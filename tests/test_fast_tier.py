"""Which tests the fast tier (scripts/test.sh --fast) leaves out: the marked ones, and those recorded in
tests/durations.json at FAST_TIER_LIMIT_S or more, but never a parity test's quickest layout under
FAST_TIER_KEPT_LIMIT_S."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import FAST_TIER_KEPT_LIMIT_S, FAST_TIER_LIMIT_S, longest_groups_first, mark_slow_by_record
from tests.harness import REPO_ROOT


class _Item:
    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.markers = nodeid, (["slow"] if slow else [])

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, mark):
        self.markers.append(mark.name)


def _slow(items):
    return sorted(i.nodeid for i in items if "slow" in i.markers)


def test_a_test_recorded_over_the_limit_is_slow_and_a_new_or_quick_one_is_not():
    items = [_Item("t.py::test_long"), _Item("t.py::test_quick"), _Item("t.py::test_new")]
    mark_slow_by_record(items, {"t.py::test_long": FAST_TIER_LIMIT_S, "t.py::test_quick": FAST_TIER_LIMIT_S - 0.1})
    assert _slow(items) == ["t.py::test_long"]


def test_the_quickest_parameter_set_not_marked_slow_stays_in_the_fast_tier_even_over_the_limit():
    items = [_Item("t.py::test_layouts[1-1]", slow=True), _Item("t.py::test_layouts[2-1]"),
             _Item("t.py::test_layouts[2-2]")]
    quickest = (FAST_TIER_LIMIT_S + FAST_TIER_KEPT_LIMIT_S) / 2
    mark_slow_by_record(items, {"t.py::test_layouts[1-1]": 0.5, "t.py::test_layouts[2-1]": quickest,
                                "t.py::test_layouts[2-2]": 30.0})
    assert _slow(items) == ["t.py::test_layouts[1-1]", "t.py::test_layouts[2-2]"]


def test_a_quickest_parameter_set_over_the_kept_limit_leaves_the_fast_tier_too():
    items = [_Item("t.py::test_layouts[2-1]"), _Item("t.py::test_layouts[2-2]")]
    mark_slow_by_record(items, {"t.py::test_layouts[2-1]": FAST_TIER_KEPT_LIMIT_S,
                                "t.py::test_layouts[2-2]": 30.0})
    assert _slow(items) == ["t.py::test_layouts[2-1]", "t.py::test_layouts[2-2]"]


def test_groups_go_out_longest_first_each_in_its_own_order_and_the_slurm_files_as_one():
    items = [_Item(n) for n in ("tests/a.py::x", "tests/a.py::y", "tests/slurm/p.py::s", "tests/b.py::z",
                                "tests/slurm/q.py::t", "tests/new.py::n")]
    seconds = {"tests/a.py::x": 5.0, "tests/a.py::y": 1.0, "tests/b.py::z": 30.0, "tests/slurm/p.py::s": 10.0,
               "tests/slurm/q.py::t": 10.0}
    assert [i.nodeid for i in longest_groups_first(items, seconds)] == [
        "tests/b.py::z", "tests/slurm/p.py::s", "tests/slurm/q.py::t", "tests/a.py::x", "tests/a.py::y",
        "tests/new.py::n"]


@pytest.mark.slow
def test_a_run_with_test_durations_out_records_each_test_by_its_collected_id_under_xdist(tmp_path):
    out = tmp_path / "durations.json"
    # One worker: the file runs whole on one anyway (loadgroup), and xdist reports its ids "@group" all the same.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "tests/test_bench_machine_drift.py"], cwd=REPO_ROOT,
                         env=dict(os.environ, TEST_DURATIONS_OUT=str(out)), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    seconds = json.loads(out.read_text())["seconds"]
    assert "tests/test_bench_machine_drift.py::test_the_drift_benchmark_prints_each_round_and_the_spread_and_writes_its_json" \
        in seconds, seconds
    assert not any("@" in k for k in seconds)
