#!/usr/bin/env bash
# Install what the tests need (CPU torch first, so nothing pulls CUDA wheels), build the
# package's C++ extension, check that the CUDA sources compile (nvcc, no GPU needed; skipped
# without nvcc; beside the tests), and run the whole test suite. Extra arguments go to pytest.
#
# --fast: the quick tier for edit-and-test loops: no installs or builds (run the full script once
# first), and only the tests not marked slow (pytest -m "not slow"; see README, Tests). Besides the
# marked ones, a test that took tests/conftest.py's FAST_TIER_LIMIT_S or more when last recorded in
# tests/durations.json is slow, unless it is its function's quickest parameter set.
#
# Every whole-suite run prints its wall time and its 20 slowest tests and records each test's seconds in
# tests/durations.json (TEST_DURATIONS_OUT, another file to keep it elsewhere), so a slowdown shows in CI's
# log and in the diff; a --fast run records only when TEST_DURATIONS_OUT is set.
#
# Tests run on TEST_WORKERS pytest-xdist workers (default 2, one per core of the development VM), a test
# file whole on one worker (tests/conftest.py groups them; the Slurm tests share one worker and cluster).
set -euo pipefail

# run_tests MARKS [pytest args]
run_tests() {
    local marks=$1
    shift
    python3 -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup -m "$marks" "$@"
}
cd "$(dirname "$0")/.."
report_wall_time() {
    local code=$?
    echo "scripts/test.sh: $((SECONDS / 60)) min $((SECONDS % 60)) s wall, exit $code" >&2
}
trap report_wall_time EXIT
if [[ "${1:-}" == "--fast" ]]; then
    shift
    if ! python3 -c "import torch, megatron_lite._C" 2>/dev/null; then
        echo "test.sh --fast: megatron_lite._C is not built here; run 'bash scripts/test.sh' once (installs and builds)" >&2
        exit 2
    fi
    run_tests "not slow" "$@"
    exit $?
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-build-isolation -e ".[test]"
# The CUDA compile check (about 34 s of one core, nvcc's front ends in turn) runs beside the tests, in the time
# their waits (timeouts, signals, Slurm's job starts) leave a core idle; its verdict counts as much as theirs.
cuda_log=$(mktemp)
bash scripts/check_cuda_compile.sh >"$cuda_log" 2>&1 &
cuda_check=$!
tests_status=0
TEST_DURATIONS_OUT=${TEST_DURATIONS_OUT:-$PWD/tests/durations.json} run_tests "slow or not slow" "$@" || tests_status=$?
cuda_status=0
wait "$cuda_check" || cuda_status=$?
cat "$cuda_log"
rm -f "$cuda_log"
if [[ $cuda_status -ne 0 ]]; then
    echo "scripts/test.sh: the CUDA compile check failed (above)" >&2
fi
exit $(( tests_status != 0 ? tests_status : cuda_status ))
