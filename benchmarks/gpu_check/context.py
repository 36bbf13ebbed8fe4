"""What every GPU-check step works with: the context (deadline-bound command runner, log), a step's
result, and the ways a step ends early. run.py runs the steps; steps.py has them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Result:
    step: str
    title: str
    status: str
    """pass, fail, timeout (its budget ran out), or skip."""
    seconds: float
    budget: float
    summary: str
    """One line for the summary table."""
    details: str = ""
    """Markdown for the step's section (tables)."""
    numbers: Dict[str, object] = field(default_factory=dict)


class StepFailed(Exception):
    """A step's own verdict: its summary line says what failed."""


class OutOfTime(TimeoutError):
    """A command ran past the step's deadline and was killed; `output` is what it printed so far."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


@dataclass
class Context:
    dry_run: bool
    work_dir: str
    """Scratch that persists between calls on the same machine (data, logs, installed wheels)."""
    python: str = sys.executable
    env: Dict[str, str] = field(default_factory=lambda: dict(os.environ))
    deadline: float = 0.0
    """The current step's deadline (time.monotonic)."""
    log: List[str] = field(default_factory=list)
    report_dir: str = ""
    """Where the report goes; steps put whole outputs there too (the log keeps tails only)."""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: List[str], env: Optional[Dict[str, str]] = None, budget: Optional[float] = None,
            check: bool = False) -> "Completed":
        """Run cmd from the repository root within the step's remaining time (or `budget`, if less);
        its whole process group is killed at the deadline. Output is kept for the log."""
        limit = max(1.0, min(self.remaining(), budget if budget is not None else float("inf")))
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            timed_out = True
        done = Completed(cmd, proc.returncode, output, time.monotonic() - start, timed_out)
        self.log.append(f"$ {' '.join(cmd)}\n# exit {done.returncode}{' (out of time)' if timed_out else ''} after "
                        f"{done.seconds:.0f}s\n{tail(output, 12000)}\n")
        if timed_out:
            raise OutOfTime(f"`{' '.join(cmd[:4])} ...` ran out of time after {done.seconds:.0f}s", output)
        if check and done.returncode != 0:
            raise StepFailed(f"`{' '.join(cmd[:4])} ...` exited {done.returncode}: {last_line(output)}")
        return done


@dataclass
class Completed:
    cmd: List[str]
    returncode: int
    output: str
    seconds: float
    timed_out: bool


def tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
