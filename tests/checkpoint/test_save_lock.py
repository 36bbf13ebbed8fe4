"""One writer per --save folder: a second run is refused at start naming the holder; a dead holder's lock is
taken over with a line saying so; saves go through temporary folders no other run uses."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.checkpoint.format import LOCK_FILE, CheckpointError
from megatron_lite.checkpoint.lock import SaveFolderLock
from tests.checkpoint.conftest import MODEL, data_args, error_line, pretrain_in_one_process
from tests.harness import REPO_ROOT, read_until

HOLD = "from megatron_lite.checkpoint.lock import SaveFolderLock; import sys, time; " \
       "SaveFolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"


def _dead_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_second_holder_is_refused_naming_the_first_and_a_release_lets_the_next_in(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    try:
        while holder.stdout.readline().strip() != "held":  # DeepSpeed's import may print first
            assert holder.poll() is None
        with pytest.raises(CheckpointError) as info:
            SaveFolderLock(str(tmp_path)).acquire()
        assert f"is in use by another run (host {os.uname().nodename}, pid {holder.pid}, started " in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock; its record says it never released it
    lock = SaveFolderLock(str(tmp_path))
    note = lock.acquire().note
    assert f"took over the lock of a run that ended without releasing it (host {os.uname().nodename}, " \
           f"pid {holder.pid}" in note
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    again = SaveFolderLock(str(tmp_path))
    assert again.acquire().note is None
    again.release()


@pytest.mark.slow
def test_two_runs_on_one_save_folder_the_second_is_refused_and_the_first_saves_a_complete_checkpoint(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    first = subprocess.Popen([sys.executable, "pretrain_gpt.py", *MODEL, *data_args(corpus), "--train-iters", "3000",
                              "--eval-iters", "0", "--save", save, "--exit-signal-handler"],
                             cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(os.path.join(save, LOCK_FILE)) and os.path.getsize(os.path.join(save, LOCK_FILE))):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = pretrain_in_one_process(corpus, ["--train-iters", "2", "--save", save])
        line = error_line(second)
        assert f"--save {save} is in use by another run (host {os.uname().nodename}, pid {first.pid}" in line
        # training, so its --exit-signal-handler is in place (before it, SIGTERM's default action applies)
        started = read_until(first.stdout, r"iteration\s+1/")
    finally:
        first.send_signal(signal.SIGTERM)  # saves at the next step and exits 0
        out, err = first.communicate(timeout=120)
    out = "".join(started) + out
    assert first.returncode == 0, out[-2000:] + err[-2000:]
    tag = open(os.path.join(save, "latest")).read()
    files = sorted(os.listdir(os.path.join(save, tag)))
    assert "megatron_lite.json" in files and "mp_rank_00_model_states.pt" in files
    assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(6)]
    assert [d for d in os.listdir(save) if d.startswith("tmp-")] == []
    assert json.load(open(os.path.join(save, tag, "megatron_lite.json")))["iteration"] == int(tag[len("iter_"):])


@pytest.mark.slow
def test_a_dead_runs_lock_is_taken_over_with_a_line_and_its_unfinished_saves_are_removed(corpus, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    dead = _dead_pid()
    (save / LOCK_FILE).write_text(json.dumps({"host": "n7", "pid": dead, "started": "yesterday", "slurm_job": "42"}))
    (save / "tmp-iter_0000004-20261124-abcdef").mkdir()  # a save the dead run never finished
    result = pretrain_in_one_process(corpus, ["--train-iters", "2", "--eval-iters", "0", "--save", str(save)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"took over the lock of a run that ended without releasing it (host n7, pid {dead}, started yesterday, " \
           f"Slurm job 42)" in result.stdout
    assert sorted(os.listdir(save)) == [LOCK_FILE, "iter_0000002", "latest", "metrics"] + \
        sorted(f for f in os.listdir(save) if f.startswith("zero_to"))
