"""DataLoader workers and the signals Slurm sends to every process of a job step.

Each case runs a small script in a process group of its own, as srun's tasks are, and
signals the whole group (trainer and its data workers), as `scancel -s USR1` does.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.harness import REPO_ROOT, read_until

pytestmark = pytest.mark.slow  # subprocesses with data workers, each a new interpreter importing torch

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import psutil
    from megatron_lite.data.sampler import build_data_iterator

    def wait_for_signals(count):
        print("ready", flush=True)
        while len(received) < count:
            time.sleep(0.05)

    dataset = [{"tokens": [i], "position_ids": [0], "labels": [i], "loss_mask": [1.0]} for i in range(400)]
    received = []
    if sys.argv[1] == "signal":
        # the trainer's own handler (training/loop.py installs one with --exit-signal-handler)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: received.append(signum))
    if sys.argv[1] == "slow_start":  # the workers take a minute to start
        from tests.data.slow_start import SlowToUnpickle
        dataset = SlowToUnpickle(dataset)
    it = build_data_iterator(dataset, 0, 2, 0, 1, num_workers=2)
    print("workers", *[w.pid for w in it._workers], flush=True)
    if sys.argv[1] in ("starting", "slow_start"):  # the workers are still starting (importing torch)
        print("ready", flush=True)
        time.sleep(600)
    if sys.argv[1] == "signal":
        wait_for_signals(2)  # while the workers start
        print("first", int(next(it)[0][0][0, 0]), flush=True)
        wait_for_signals(4)  # while they serve
        time.sleep(0.2)
        # a child killed by a signal stays a zombie until reaped: workers, and multiprocessing's resource tracker
        dead = [p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
        print("dead children", dead, flush=True)
        print("next", int(next(it)[0][0][0, 0]), flush=True)
        sys.exit(0)
    print("first", int(next(it)[0][0][0, 0]), flush=True)
    if sys.argv[1] == "abandoned":
        # What a CI run hung on: the iterator is gone but PyTorch's shutdown did not stop its
        # worker (here: marked done, so __del__ does nothing), and SIGTERM, all that is left
        # to stop it with, is ignored.
        it._shutdown = True
        del it
        print("ready", flush=True)
        sys.exit(0)
    print("ready", flush=True)
    time.sleep(600)
""")


def _start(mode):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = read_until(proc.stdout, "^ready")
    pids = [int(pid) for line in lines if line.startswith("workers") for pid in line.split()[1:]]
    assert len(pids) == 2, "".join(lines)
    try:  # and the helpers that start with them (multiprocessing's resource tracker)
        pids += [p.pid for p in psutil.Process(proc.pid).children(recursive=True) if p.pid not in pids]
    except psutil.NoSuchProcess:  # "abandoned" exits at once
        pass
    return proc, _existing(pids), lines


def _existing(pids):
    """psutil handles of those pids whose process has not exited yet."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def still_running(procs, timeout):
    """Those of procs still running after timeout s. An exited process whose parent died stays a
    zombie until init reaps it, which counts as stopped."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal_group(proc):
    """What Slurm sends before a time limit, to every process of the job step."""
    os.killpg(proc.pid, signal.SIGUSR1)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)


def test_a_signal_to_the_whole_process_group_leaves_data_workers_running_and_the_loader_working():
    proc, workers, lines = _start("signal")
    try:
        _signal_group(proc)  # while the workers start
        lines.extend(read_until(proc.stdout, "^ready"))
        _signal_group(proc)  # while they serve
        out, _ = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    out = "".join(lines) + out
    # exits on its own, promptly: the workers ignoring SIGTERM must not hang interpreter exit
    assert proc.returncode == 0, out
    assert "first 0" in out and "next 2" in out and "dead children []" in out
    assert "killed by signal" not in out


@pytest.mark.parametrize("mode", ["wait", "starting", "slow_start"],
                         ids=["serving", "while_starting", "while_a_slow_start_runs"])
def test_data_workers_stop_when_their_trainer_is_killed(mode):
    proc, workers, _ = _start(mode)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        alive = still_running(workers, timeout=30)
        assert not alive, f"data workers or their helpers {[p.pid for p in alive]} outlived their trainer"
    finally:
        _kill_group(proc)


def test_a_process_whose_iterator_left_workers_behind_still_exits():
    proc, workers, lines = _start("abandoned")
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, "".join(lines) + out
    assert not still_running(workers, timeout=10)
