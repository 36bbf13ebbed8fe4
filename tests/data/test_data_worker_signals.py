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

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # subprocesses with data workers; PyTorch's workers look for their parent every 5 s

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_lite.data.sampler import build_data_iterator

    dataset = [{"tokens": [i], "position_ids": [0], "labels": [i], "loss_mask": [1.0]} for i in range(400)]
    received = []
    it = build_data_iterator(dataset, 0, 2, 0, 1, num_workers=2)
    print("first", int(next(it)[0][0][0, 0]), flush=True)
    if sys.argv[1] == "signal":
        # the trainer's own handler (training/loop.py installs one with --exit-signal-handler)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: received.append(signum))
        print("ready", flush=True)
        while len(received) < 2:
            time.sleep(0.05)
        print("next", int(next(it)[0][0][0, 0]), flush=True)
        sys.exit(0)
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
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == 2, "".join(lines)
    return proc, workers, lines


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


def test_a_signal_to_the_whole_process_group_leaves_data_workers_running_and_the_loader_working():
    proc, workers, lines = _start("signal")
    try:
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    out = "".join(lines) + out
    # exits on its own, promptly: the workers ignoring SIGTERM must not hang interpreter exit
    assert proc.returncode == 0, out
    assert "first 0" in out and "next 2" in out
    assert "killed by signal" not in out


def test_data_workers_stop_when_their_trainer_is_killed():
    proc, workers, _ = _start("wait")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        alive = still_running(workers, timeout=30)
        assert not alive, f"data workers {[p.pid for p in alive]} outlived their trainer"
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
