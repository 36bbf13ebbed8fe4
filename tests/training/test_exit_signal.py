"""ExitSignal: what --exit-signal-handler leaves behind once the run has stopped.

Slurm signals a job step node by node, so one rank can be told to stop by the others (the ranks
agree on a stop) and get its own USR1 only while its interpreter exits; Python's finalization
has by then put back the default action (death) of every signal it handled. Once the run stops,
the signals are therefore ignored, not left to a Python handler.
"""
import os
import signal
import subprocess
import sys

from tests.harness import REPO_ROOT

_CHILD = """
import os, signal
from megatron_lite.training.exit_signal import ExitSignal
exit_signal = ExitSignal({enabled})
{send}
exit_signal.release()
print(exit_signal.received, *(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1)))
# a late signal after the run stopped must not end the process with a signal
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGTERM)
"""


def _run_child(enabled: bool, send: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", _CHILD.format(enabled=enabled, send=send)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_after_the_run_stops_a_late_term_or_usr1_is_ignored_so_the_rank_still_exits_0():
    child = _run_child(True, "os.kill(os.getpid(), signal.SIGUSR1)")
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[-1].split() == ["True", "True", "True"]


def test_without_the_handler_the_default_actions_are_left_alone():
    child = _run_child(False, "")
    assert child.returncode == -signal.SIGUSR1, (child.returncode, child.stderr)
    assert child.stdout.splitlines()[-1].split() == ["False", "False", "False"]
