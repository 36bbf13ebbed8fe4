"""The progress watchdog (training/watchdog.py, training/progress.py): a rank stuck outside any collective ends the
job step within its phase's timeout, with its stack in the log, one line naming it, and exit code 42.

The ranks start as plain srun starts them (test_exit_signal_to_job_step._start_ranks: RANK, LOCAL_RANK, no launcher
process), so each rank's own exit code is what the test reads, as srun would pass it on; one test runs under torchrun
to pin down what its agent makes of it.
"""
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_lite import drills
from megatron_lite.exit_codes import EXIT_HANG
from megatron_lite.training import progress
from megatron_lite.training.watchdog import CALIBRATION_COUNT, Timeouts
from tests.data.test_data_worker_signals import still_running
from tests.harness import REPO_ROOT, read_until, start_launcher, write_null_corpus
from tests.training.test_exit_signal_to_job_step import _end_ranks, _start_ranks

STEP_TIMEOUT_S = 6.0
SLACK_S = 30.0  # the bound: phase timeout + 30 s


@pytest.fixture(scope="module")
def null_corpus(tmp_path_factory):
    return write_null_corpus(str(tmp_path_factory.mktemp("watchdog") / "null_text_document"), 200, 64)


def tiny(prefix, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--vocab-size", "64", "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split",
            "90,10,0", "--num-workers", "0", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
            "--lr", "1e-3", "--distributed-timeout-minutes", "5",
            "--watchdog-step-timeout-minutes", str(STEP_TIMEOUT_S / 60), *extra]


def _family(procs):
    family = [psutil.Process(p.pid) for p in procs]
    return family + [c for p in family for c in p.children(recursive=True)]


def _monitors():
    return [p for p in psutil.process_iter(["cmdline"])
            if "megatron_lite.training.watchdog" in " ".join(p.info["cmdline"] or [])]


def run_until_the_watchdog_ends_it(argv, tmp_path, env=None, stop_rank_1_after=None):
    """Two srun-style ranks; optionally SIGSTOP rank 1 once `stop_rank_1_after` is printed. (rank 0's output with
    the monitor's, rank 1's log, exit codes, seconds from the hang's start to the end)."""
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        procs = _start_ranks(argv, 2, tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(old)
    monitors_before = {p.pid for p in _monitors()}
    try:
        lines = read_until(procs[0].stdout, stop_rank_1_after or r"iteration\s+1/")
        family = _family(procs)
        monitors = [p for p in _monitors() if p.pid not in monitors_before]
        if stop_rank_1_after:
            procs[1].send_signal(signal.SIGSTOP)
        started = time.monotonic()
        out, _ = procs[0].communicate(timeout=STEP_TIMEOUT_S + SLACK_S)
        procs[1].wait(timeout=10)
        waited = time.monotonic() - started
    finally:
        _end_ranks(procs)
    assert not still_running(family + monitors, timeout=15), "a rank, data worker or monitor outlived the job step"
    return "".join(lines) + out, (tmp_path / "rank1.log").read_text(), [p.returncode for p in procs], waited


def one_watchdog_line(out):
    found = [line for line in out.splitlines() if re.match(r"watchdog: rank \d+ on ", line)]
    assert len(found) == 1, out
    return found[0]


@pytest.mark.slow
def test_a_rank_stopped_by_sigstop_mid_training_is_named_and_every_rank_exits_42(null_corpus, tmp_path):
    out, log1, codes, waited = run_until_the_watchdog_ends_it(
        tiny(null_corpus, "--train-iters", "100000"), tmp_path, stop_rank_1_after=r"iteration\s+3/")
    assert codes == [EXIT_HANG, EXIT_HANG], out + log1
    line = one_watchdog_line(out)
    assert re.match(r"watchdog: rank 1 on \S+ made no progress in phase (data|forward_backward|optimizer) at "
                    r"iteration \d+ for \d+s \(timeout 6s\)", line), line
    assert re.search(r"watchdog: stack of rank 1 \(pid \d+.*\n(Thread|Current thread) 0x", out), out
    assert STEP_TIMEOUT_S <= waited <= STEP_TIMEOUT_S + SLACK_S


@pytest.mark.slow
def test_a_python_deadlock_in_one_rank_ends_the_step_with_its_stack_in_the_log(null_corpus, tmp_path):
    out, log1, codes, _ = run_until_the_watchdog_ends_it(
        tiny(null_corpus, "--train-iters", "100000"), tmp_path, env={drills.INJECT_ENV: "deadlock:1:3"})
    assert codes == [EXIT_HANG, EXIT_HANG], out + log1
    # Which rank the line names is the monitor's guess (training/watchdog.py overdue(): both ranks sit in
    # forward_backward at iteration 3, the other one in the all-reduce); under load it named rank 0 once in a
    # suite run. The deadlocked rank's own stack, down to the lock, is the evidence.
    assert re.match(r"watchdog: rank [01] on \S+ made no progress in phase forward_backward at iteration 3 ",
                    one_watchdog_line(out))
    assert 'in hang_forever' in out, out


@pytest.mark.slow
def test_a_data_worker_that_sleeps_forever_ends_the_step_in_the_data_phase(null_corpus, tmp_path):
    argv = tiny(null_corpus, "--train-iters", "100000", "--num-workers", "1")
    out, log1, codes, _ = run_until_the_watchdog_ends_it(argv, tmp_path, env={drills.INJECT_ENV: "data_worker:1:6"})
    assert codes == [EXIT_HANG, EXIT_HANG], out + log1
    assert re.match(r"watchdog: rank 1 on \S+ made no progress in phase data ", one_watchdog_line(out)), out
    assert "_next_data" in out or "_get_data" in out, out  # rank 1 waits on its DataLoader


@pytest.mark.slow
def test_an_async_checkpoint_finalize_that_blocks_ends_the_step_in_the_checkpoint_phase(null_corpus, tmp_path):
    argv = tiny(null_corpus, "--train-iters", "100000", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                "--async-save", "--watchdog-checkpoint-timeout-minutes", str(STEP_TIMEOUT_S / 60))
    out, log1, codes, _ = run_until_the_watchdog_ends_it(argv, tmp_path,
                                                         env={drills.INJECT_ENV: "checkpoint_finalize:1:2"})
    assert codes == [EXIT_HANG, EXIT_HANG], out + log1
    assert re.match(r"watchdog: rank \d on \S+ made no progress in phase checkpoint at iteration 4 ",
                    one_watchdog_line(out)), out
    assert "in maybe_hang_in_finalize" in out, out  # the async-save thread's stack, where it blocks
    assert not (tmp_path / "ckpt" / "latest").exists()  # the blocked save was never published half-written


@pytest.mark.slow
def test_under_torchrun_the_agent_reports_exitcode_42_and_itself_exits_1(null_corpus):
    proc = start_launcher(["pretrain_gpt.py", *tiny(null_corpus, "--train-iters", "100000")], nproc=2,
                          env={drills.INJECT_ENV: "deadlock:1:2"}, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out  # torchrun raises ChildFailedError for any failed worker: exit 1
    assert re.search(rf"exitcode\s*: {EXIT_HANG}", out), out
    one_watchdog_line(out)


@pytest.mark.slow
def test_a_normal_run_exits_0_and_leaves_no_monitor_behind(null_corpus, tmp_path, monkeypatch):
    channel = str(tmp_path / "channel")  # this run's monitor, told from other tests' (xdist's other worker)
    monkeypatch.setenv(progress.DIRECTORY_ENV, channel)
    procs = _start_ranks(tiny(null_corpus, "--train-iters", "3"), 2, tmp_path)
    out, _ = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], out + (tmp_path / "rank1.log").read_text()
    assert "watchdog:" not in out

    def ours():
        return [p for p in _monitors() if channel in " ".join(p.info["cmdline"] or [])]

    deadline = time.monotonic() + 5
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours(), "the monitor outlived the run"


def test_a_phase_waits_for_the_startup_timeout_until_timed_enough_then_for_factor_times_its_longest():
    t = Timeouts(startup=600.0, step=None, checkpoint=None, evaluation=None, factor=5.0, floor=30.0)
    assert t.for_phase("startup", 0, 0.0) == 600.0
    assert t.for_phase("forward_backward", CALIBRATION_COUNT - 1, 20.0) == 600.0
    assert t.for_phase("forward_backward", CALIBRATION_COUNT, 20.0) == 100.0
    assert t.for_phase("data", CALIBRATION_COUNT, 0.01) == 30.0  # the floor
    assert t.for_phase("checkpoint", 0, 0.0) == 600.0
    explicit = Timeouts(startup=600.0, step=7.0, checkpoint=9.0, evaluation=None, factor=5.0, floor=30.0)
    assert [explicit.for_phase(p, 0, 0.0) for p in ("data", "optimizer", "checkpoint", "evaluation")] == \
        [7.0, 7.0, 9.0, 600.0]


def test_a_record_is_one_fixed_width_line_and_a_torn_one_reads_as_none():
    record = progress.format_record(123, 7, "data", 5.25, {"data": 3}, {"data": 0.5})
    assert len(record) == progress.RECORD_BYTES and record.endswith(b"\n")
    pid, iteration, phase, since, seen = progress.parse_record(record)
    assert (pid, iteration, phase, since, seen["data"], seen["optimizer"]) == (123, 7, "data", 5.25, (3, 0.5),
                                                                                (0, 0.0))
    assert progress.parse_record(record[:20]) is None


@pytest.mark.parametrize("argv, env, message", [
    (["--no-watchdog", "--watchdog-step-timeout-minutes", "1"], {},
     r"--watchdog-step-timeout-minutes with --no-watchdog sets a timeout nothing watches"),
    ([], {drills.INJECT_ENV: "deadlock:one:3"}, r"MEGATRON_LITE_INJECT_HANG 'deadlock:one:3' must be KIND:RANK"),
    (["--no-watchdog"], {drills.INJECT_ENV: "deadlock:1:3"}, r"injects a hang with --no-watchdog"),
], ids=["timeout-without-watchdog", "malformed-drill", "drill-without-watchdog"])
def test_bad_watchdog_input_exits_2_with_one_line_before_any_process_group(argv, env, message, null_corpus):
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *tiny(null_corpus)[:-2], *argv], cwd=REPO_ROOT,
                            env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.stderr
