"""--async-save through pretrain_gpt.py (torchrun where a kill or a signal is the subject): the exit paths wait for the save in flight, a kill -9
while the background writer runs keeps the previous checkpoint, and a resume continues the same curve."""
import re
import signal

import pytest

from tests.harness import signal_process_tree
from tests.training.test_pretrain_e2e import (
    _launch_background,
    _wait_for,
    layout,
    losses_by_iteration,
    pretrain,
)

pytestmark = pytest.mark.slow


def _writing(ckpt):
    """Tags whose files the background writer has begun to write: a temporary folder with a file in it (the
    main thread only creates the folder; every file in it is the writer's)."""
    tags = []
    for folder in ckpt.iterdir() if ckpt.exists() else ():
        try:
            if folder.name.startswith("tmp-") and any(folder.iterdir()):
                tags.append(folder.name.split("-")[1])
        except FileNotFoundError:  # committed (renamed) meanwhile
            pass
    return tags


def _catch_the_writer(proc, ckpt):
    """Freeze every process of the run while a background write is under way: the tag being written."""
    while _wait_for(lambda: _writing(ckpt), proc):
        signal_process_tree(proc.pid, signal.SIGSTOP)
        tags = _writing(ckpt)
        if tags:
            return tags[0]
        signal_process_tree(proc.pid, signal.SIGCONT)
    raise AssertionError("never caught the background writer at work")


def test_an_async_saved_run_resumes_with_the_uninterrupted_losses(corpus, tmp_path):
    common = layout(1, 2) + ["--train-iters", "6", "--lr-decay-iters", "6", "--async-save"]
    straight = pretrain(corpus, 2, common + ["--save", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr
    first = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--save-interval", "1", "--exit-interval",
                                          "3"])
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "b" / "latest").read_text() == "iter_0000003"
    assert "training goes on while it is written" in first.stdout
    second = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert second.returncode == 0, second.stderr
    assert "at iteration 3" in second.stdout
    resumed = {**losses_by_iteration(first.stdout), **losses_by_iteration(second.stdout)}
    assert resumed == losses_by_iteration(straight.stdout)


def test_kill_9_while_the_background_writer_runs_keeps_the_previous_checkpoint_and_resumes_from_it(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _launch_background(corpus, 2, layout(1, 2) + ["--train-iters", "200", "--save", str(ckpt),
                                                         "--save-interval", "1", "--async-save"])
    try:
        assert _wait_for(lambda: (ckpt / "latest").exists(), proc), "no first checkpoint was committed"
        in_flight = _catch_the_writer(proc, ckpt)
        signal_process_tree(proc.pid, signal.SIGKILL)
    finally:
        signal_process_tree(proc.pid, signal.SIGKILL)
        proc.communicate()
    tag = (ckpt / "latest").read_text()
    assert tag < in_flight and (ckpt / tag / "megatron_lite.json").exists()
    assert not (ckpt / in_flight).exists()
    saved = int(tag.split("_")[1])
    resumed = pretrain(corpus, 2, layout(1, 2) + ["--train-iters", str(saved + 2), "--save", str(ckpt),
                                                  "--load", str(ckpt), "--async-save", "--override-opt-param-scheduler"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"at iteration {saved}" in resumed.stdout
    assert sorted(losses_by_iteration(resumed.stdout)) == [saved + 1, saved + 2]
    assert not any(p.name.startswith("tmp-") for p in ckpt.iterdir()), "the killed run's temporary folder stayed"


def test_sigterm_while_the_background_writer_runs_commits_it_and_the_final_save_and_exits_0(corpus, tmp_path):
    import psutil

    ckpt = tmp_path / "ckpt"
    proc = _launch_background(corpus, 2, layout(1, 2) + ["--train-iters", "1000", "--save", str(ckpt),
                                                         "--save-interval", "1", "--async-save",
                                                         "--exit-signal-handler"])
    try:
        in_flight = _catch_the_writer(proc, ckpt)
        # What Slurm does before a time limit: signal every task (they are frozen, so it waits for them).
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.send_signal(signal.SIGTERM)
        signal_process_tree(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            signal_process_tree(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    assert "exit signal received" in out
    last = (ckpt / "latest").read_text()
    assert last >= in_flight and (ckpt / in_flight / "megatron_lite.json").exists()
    stopped = int(re.findall(r"stopped after iteration (\d+)", out)[-1])
    assert last == f"iter_{stopped:07d}"
    assert not any(p.name.startswith("tmp-") for p in ckpt.iterdir())
