"""tests/entry_points.py and tests/artefacts.py: a script's main on warm ranks gives what the launcher gives,
and what it changes in a worker is undone; a shared artefact is built once however many processes ask."""
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.entry_points import run_entry
from tests.harness import REPO_ROOT, run_distributed, run_launcher
from tests.training.test_pretrain_e2e import MODEL, data_args, layout, losses_by_iteration


def _losses_and_validation(text):
    return losses_by_iteration(text), re.findall(r"validation at iteration \d+ \| loss (\S+)", text)


@pytest.mark.slow
def test_pretrain_on_warm_ranks_prints_the_losses_a_torchrun_launch_prints(corpus):
    argv = ["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(1, 2), "--train-iters", "3", "--eval-interval", "3"]
    cold = run_launcher(argv, nproc=2)
    warm = run_entry(argv, 2)
    assert cold.returncode == warm.returncode == 0, cold.stderr[-2000:] + warm.stderr[-2000:]
    assert sorted(losses_by_iteration(warm.stdout)) == [1, 2, 3]
    assert _losses_and_validation(warm.stdout) == _losses_and_validation(cold.stdout)


def _pids():
    return os.getpid()


def test_a_run_that_destroys_the_world_group_leaves_the_pool_usable_by_the_same_workers(corpus):
    before = run_distributed(_pids, 2)
    bad = run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(3, 1), "--train-iters", "1"], 2)
    assert bad.returncode == 2 and "--tensor-model-parallel-size 3" in bad.stderr, bad.stderr
    good = run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(2, 1), "--train-iters", "2",
                      "--eval-iters", "0"], 2)
    assert good.returncode == 0, good.stderr[-2000:]  # its end destroyed the world group: made again below
    assert run_distributed(_pids, 2) == before


SCRIPT = textwrap.dedent("""
    import os, signal, sys, logging

    def main(argv):
        os.environ["LEFT_BY_THE_SCRIPT"] = "1"
        os.chdir("/")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.getLogger("deepspeed").setLevel(logging.CRITICAL)
        print("out", os.environ.get("GIVEN"), os.environ["RANK"], flush=True)
        os.write(2, b"from C\\n")
        if argv == ["fail"] and os.environ["RANK"] == "1":
            raise ValueError("rank 1 failed")
        sys.exit(int(argv[0]) if argv and argv[0].isdigit() else 0)
""")


def _process_state():
    import logging

    return (os.environ.get("LEFT_BY_THE_SCRIPT"), os.getcwd(), signal.getsignal(signal.SIGTERM) is signal.SIG_IGN,
            logging.getLogger("deepspeed").level)


def test_exit_codes_output_and_what_the_script_changed_come_back_as_a_process_would_leave_them(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    before = run_distributed(_process_state, 2)
    done = run_entry([str(script), "3"], 2, env={"GIVEN": "yes"})
    assert done.returncode == 3
    assert done.stdout == "out yes 0\nout yes 1\n" and done.stderr == "from C\nfrom C\n"
    failed = run_entry([str(script), "fail"], 2)
    assert failed.returncode == 1 and "ValueError: rank 1 failed" in failed.stderr
    assert run_distributed(_process_state, 2) == before


def _environ(name):
    return os.environ.get(name)


def test_workers_see_the_test_process_environment_as_it_is_when_their_pool_starts(monkeypatch):
    from tests.harness import shutdown_pools

    shutdown_pools()
    monkeypatch.setenv("MEGATRON_LITE_TEST_PROBE", "set after the fork server started")
    assert run_distributed(_environ, 2, "MEGATRON_LITE_TEST_PROBE") == ["set after the fork server started"] * 2


BUILDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.artefacts import built_once

    class Factory:
        def getbasetemp(self):
            return {base!r}

    def build(folder):
        with open({count!r}, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)  # the other process asks meanwhile
        (folder / "artefact").write_text("made")

    print((built_once(Factory(), "thing", build) / "artefact").read_text())
""")


def test_an_artefact_asked_for_by_two_processes_at_once_is_built_once(tmp_path):
    count = tmp_path / "builds.txt"
    code = BUILDER.format(root=REPO_ROOT, base=str(tmp_path / "run"), count=str(count))
    (tmp_path / "run").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert outs == ["made\n", "made\n"]
    assert count.read_text() == "built\n"
