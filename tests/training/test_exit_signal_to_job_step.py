"""--exit-signal-handler when the signal reaches every process of the job step, as Slurm sends it.

`scancel -s USR1` and `--signal=USR1@T` signal each process of the step: the ranks and their
DataLoader workers. The ranks here are started as plain `srun` starts them (RANK, WORLD_SIZE,
no launcher process) in one process group, and the group is signalled.
"""
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.harness import free_port, read_until
from tests.data.test_data_worker_signals import still_running
from tests.harness import REPO_ROOT
from tests.training.test_pretrain_e2e import MODEL, data_args, layout, losses_by_iteration, pretrain

pytestmark = pytest.mark.slow


def _start_ranks(argv, world_size, log_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
               PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for rank in range(world_size):
        out = subprocess.PIPE if rank == 0 else open(log_dir / f"rank{rank}.log", "w")
        group = procs[0].pid if rank else 0  # one process group, as a job step's tasks
        procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv], cwd=REPO_ROOT,
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=out,
                                      stderr=subprocess.STDOUT, text=True, process_group=group))
    return procs


def _end_ranks(procs):
    """Whatever is left of _start_ranks' ranks, ended: a stopped one continued first so that it can die."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(timeout=30)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_signal_to_every_process_of_the_step_with_data_workers_saves_exits_0_and_resumes(
        corpus, tmp_path, signum):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    common = [*MODEL, *data_args(corpus), *layout(1, 2), "--num-workers", "2", "--save", str(ckpt)]
    procs = _start_ranks([*common, "--train-iters", "1000", "--exit-signal-handler"], 2, tmp_path)
    try:
        lines = read_until(procs[0].stdout, r"iteration\s+2/1000")
        # the data workers are there to be signalled (each rank's other child: multiprocessing's resource tracker)
        workers = [c for p in procs for c in psutil.Process(p.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 4, "".join(lines)
        os.killpg(procs[0].pid, signum)
        out, _ = procs[0].communicate(timeout=240)
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "".join(lines) + out
    assert [p.returncode for p in procs] == [0, 0], out + (tmp_path / "rank1.log").read_text()
    assert "exit signal received" in out and "killed by signal" not in out
    saved = int(open(ckpt / "latest").read().split("_")[1])
    assert 2 <= saved < 1000
    assert not still_running(workers, timeout=30), "data workers outlived their ranks"

    # Resumed without data workers: where the data resumes is the checkpoint's consumed samples, whoever
    # loads them, and four spawned workers cost ~5 CPU-seconds of imports.
    resumed = pretrain(corpus, 2, layout(1, 2) + ["--num-workers", "0", "--train-iters", str(saved + 2),
                                                  "--save", str(ckpt), "--load", str(ckpt),
                                                  "--override-opt-param-scheduler"])  # decays over the new length
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"at iteration {saved}" in resumed.stdout
    assert sorted(losses_by_iteration(resumed.stdout)) == [saved + 1, saved + 2]
