"""The trainer's answer to SIGTERM / SIGUSR1: save at the next step boundary and stop (training/loop.py)."""
from __future__ import annotations

import signal

from megatron_lite.data.workers import TRAINER_SIGNALS


class ExitSignal:
    """SIGTERM / SIGUSR1 (what Slurm sends before a time limit) -> save at the next step boundary."""

    def __init__(self, enabled: bool):
        self.received = False
        self.enabled = enabled
        if enabled:
            for sig in TRAINER_SIGNALS:
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        """Ignore TERM/USR1 from here on: the run has stopped, so a late one has nothing left to ask.
        Left to a Python handler, a signal that lands while the interpreter exits kills the process,
        because Python's finalization puts back the default action of every signal it handled (but
        not of ignored ones): Slurm delivers a step's signal to each node on its own, so a rank can
        get it after the others agreed to stop, and its task then ends 'User defined signal 1' though
        the checkpoint was saved."""
        if self.enabled:
            for sig in TRAINER_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
