"""A refusal every rank reaches is printed once, by rank 0, and seen whatever the launcher does next.

Why: every rank validates the same flags and refuses together, but only rank 0 prints (one line, not one per
rank). Under torchrun the first rank to exit non-zero makes the agent stop the others: when rank 1 exited first,
rank 0 was killed before it printed, and the user saw only torchrun's ChildFailedError (4 of 10 runs, issue 61).
So a rank other than 0 does not exit before rank 0 has printed: rank 0 prints, flushes, then leaves a marker
holding the message in a folder of the job's own on this node; the others wait for that marker (up to
WAIT_SECONDS) and then exit silently. A rank that waited in vain (rank 0 on another node, or rank 0 did not refuse)
prints the line itself, naming its rank.
"""
from __future__ import annotations

import getpass
import hashlib
import os
import sys
import tempfile
import time
from typing import NoReturn

from megatron_lite.atomic import WriteError, write_text

WAIT_SECONDS = 10.0
"""How long a rank other than 0 waits for rank 0's line: rank 0 runs the same checks on the same inputs."""


def launcher_rank() -> int:
    """This process's rank as the launcher says (torchrun / deepspeed / srun), 0 without one."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _marker_path() -> str:
    """A file of this job's on this node: from the launcher's identity of the job, as every rank sees it."""
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    job = "|".join(os.environ.get(k, "") for k in keys)
    folder = os.path.join(tempfile.gettempdir(), f"megatron_lite_refusal-{getpass.getuser()}")
    return os.path.join(folder, hashlib.sha1(job.encode()).hexdigest()[:16])


def say_once(line: str) -> None:
    """Print `line` (an error of every rank's) on stderr from rank 0; on other ranks, return once rank 0 has
    printed it, or print it naming the rank after WAIT_SECONDS."""
    rank = launcher_rank()
    path = _marker_path()
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_text(path, line)  # whole or not at all: a waiting rank never reads half a line
        except (OSError, WriteError):
            pass  # the others then print it themselves
        return
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if f.read() == line and time.time() - os.path.getmtime(path) < WAIT_SECONDS + 60:
                    return  # rank 0 said it (this run's: the same line, written just now)
        except OSError:
            pass
        time.sleep(0.02)
    print(f"{line} (rank {rank})", file=sys.stderr, flush=True)


def refuse(line: str, code: int = 2) -> NoReturn:
    """say_once(line), then exit with `code`."""
    say_once(line)
    sys.exit(code)
