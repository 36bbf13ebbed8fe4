"""The progress watchdog: one monitor process per node, outside the ranks, that ends a run a rank stopped advancing.

Collective timeouts (--distributed-timeout-minutes) catch a rank stuck in a collective; nothing catches one stuck
elsewhere: a data worker that never delivers, storage, an async save's finalize, a Python deadlock. Each rank writes
its phase and iteration to a file (training/progress.py); the monitor, started by local rank 0 before training, reads
the files every POLL_SECONDS and gives each phase a timeout:

  startup                                       --watchdog-startup-timeout-minutes
  data, forward_backward, optimizer             --watchdog-step-timeout-minutes
  checkpoint                                    --watchdog-checkpoint-timeout-minutes
  evaluation                                    --watchdog-evaluation-timeout-minutes

A phase without its flag is calibrated: the start-up timeout until the phase has been timed CALIBRATION_COUNT times
on that rank, then --watchdog-timeout-factor x its longest time so far, at least --watchdog-min-timeout-minutes
(NVIDIA's resiliency extension does the same, with 5x).

On a timeout: every local rank's Python stack (faulthandler, on progress.STACK_SIGNAL) is copied to stderr, one line
names the stuck rank, node, phase and iteration, the node's ranks are ended with exit code EXIT_HANG, and the monitor
exits with it too. The monitor leaves when no rank of its node is left to watch (each rank marks its own end), so it
never holds a finished job.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_lite import fault_log
from megatron_lite.exit_codes import EXIT_HANG
from megatron_lite.training import progress

POLL_SECONDS = 0.5
CALIBRATION_COUNT = 5
"""Times a phase must have ended on a rank before its calibrated timeout replaces the start-up one."""
STACK_WAIT_SECONDS = 2.0
"""How long the ranks get to write their stacks after the stack signal (faulthandler writes at once)."""
END_WAIT_SECONDS = 10.0
"""How long the ranks get to end on EXIT_SIGNAL before SIGKILL."""
STEP_PHASES = ("data", "forward_backward", "optimizer")


@dataclass(frozen=True)
class Timeouts:
    """Seconds; None = calibrated."""
    startup: float
    step: Optional[float]
    checkpoint: Optional[float]
    evaluation: Optional[float]
    factor: float
    floor: float

    @classmethod
    def from_config(cls, w) -> "Timeouts":
        seconds = lambda minutes: None if minutes is None else minutes * 60.0  # noqa: E731
        return cls(seconds(w.watchdog_startup_timeout_minutes), seconds(w.watchdog_step_timeout_minutes),
                   seconds(w.watchdog_checkpoint_timeout_minutes), seconds(w.watchdog_evaluation_timeout_minutes),
                   w.watchdog_timeout_factor, seconds(w.watchdog_min_timeout_minutes))

    def argv(self) -> List[str]:
        args = ["--startup", str(self.startup), "--factor", str(self.factor), "--floor", str(self.floor)]
        for name in ("step", "checkpoint", "evaluation"):
            if getattr(self, name) is not None:
                args += [f"--{name}", str(getattr(self, name))]
        return args

    def for_phase(self, phase: str, count: int, longest: float) -> float:
        """The phase's timeout on a rank that has ended it `count` times, the longest in `longest` seconds."""
        if phase == "startup":
            return self.startup
        explicit = self.step if phase in STEP_PHASES else getattr(self, phase, None)
        if explicit is not None:
            return explicit
        if count < CALIBRATION_COUNT:
            return self.startup
        return max(self.floor, self.factor * longest)


@dataclass
class Rank:
    rank: int
    pid: int
    iteration: int
    phase: str
    since: float
    seen: Dict[str, tuple]


def read_ranks(directory: str) -> Dict[int, Rank]:
    """The ranks that report here and are still running: alive, not ended."""
    ranks = {}
    for path in glob.glob(os.path.join(directory, "rank*.progress")):
        match = re.fullmatch(r"rank(\d+)\.progress", os.path.basename(path))
        try:
            with open(path, "rb") as f:
                record = progress.parse_record(f.read(progress.RECORD_BYTES))
        except OSError:
            continue
        if match is None or record is None:
            continue
        pid, iteration, phase, since, seen = record
        if phase != progress.ENDED and _alive(pid):
            ranks[int(match.group(1))] = Rank(int(match.group(1)), pid, iteration, phase, since, seen)
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def overdue(ranks: Dict[int, Rank], timeouts: Timeouts, now: float) -> List[tuple]:
    """When a rank is past its phase's timeout: (rank, seconds in its phase, its timeout) of each rank past half of
    its own, the likely culprit first (the others wait on it in a collective, often a little longer): a stopped
    process, then the rank furthest behind, then one waiting on its own data, then the longest in its phase."""
    late, any_over = [], False
    for r in ranks.values():
        count, longest = r.seen.get(r.phase, (0, 0.0))
        limit = timeouts.for_phase(r.phase, count, longest)
        any_over |= now - r.since > limit
        if now - r.since > limit / 2:
            late.append((r, now - r.since, limit))
    if not any_over:
        return []
    return sorted(late, key=lambda x: (not _stopped(x[0].pid), x[0].iteration, x[0].phase != "data", x[0].since))


def end_ranks(directory: str, ranks: Dict[int, Rank], culprit: tuple) -> None:
    """Stacks into the log, the one line, then every local rank ended with EXIT_HANG."""
    rank, waited, limit = culprit
    for r in ranks.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, progress.STACK_SIGNAL)
            os.kill(r.pid, signal.SIGCONT)  # a stopped rank writes its stack when it runs again
    time.sleep(STACK_WAIT_SECONDS)
    for r in sorted(ranks.values(), key=lambda r: r.rank):
        try:
            with open(progress.stack_path(directory, r.rank)) as f:
                stack = f.read()
        except OSError:
            stack = "(no stack file)\n"
        sys.stderr.write(f"watchdog: stack of rank {r.rank} (pid {r.pid}, phase {r.phase}, iteration {r.iteration}):\n"
                         f"{stack}\n")
    sys.stderr.write(f"watchdog: rank {rank.rank} on {socket.gethostname()} made no progress in phase {rank.phase} at "
                     f"iteration {rank.iteration} for {waited:.0f}s (timeout {limit:.0f}s); ending this node's "
                     f"ranks with exit code {EXIT_HANG}\n")
    sys.stderr.flush()
    fault_log.record(EXIT_HANG, "hang", rank=rank.rank, iteration=rank.iteration,
                     detail=f"no progress in phase {rank.phase} for {waited:.0f}s")
    for r in ranks.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, progress.EXIT_SIGNAL)
            os.kill(r.pid, signal.SIGCONT)
    deadline = time.monotonic() + END_WAIT_SECONDS
    while any(_alive(r.pid) for r in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for r in ranks.values():
        if _alive(r.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.pid, signal.SIGKILL)
    for r in ranks.values():
        for path in (progress.progress_path(directory, r.rank), progress.stack_path(directory, r.rank)):
            with contextlib.suppress(OSError):
                os.unlink(path)


def monitor(directory: str, timeouts: Timeouts) -> int:
    """Watch until no rank is left (0) or one is stuck (EXIT_HANG)."""
    while True:
        ranks = read_ranks(directory)
        if not ranks:
            _remove_when_empty(directory)
            return 0
        late = overdue(ranks, timeouts, time.monotonic())
        if late:
            end_ranks(directory, ranks, late[0])
            _remove_when_empty(directory)
            return EXIT_HANG
        time.sleep(POLL_SECONDS)


def _remove_when_empty(directory: str, seconds: float = 2.0) -> None:
    """The channel's folder, once the ranks that ended have removed their files (they mark the end first)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def start_monitor(directory: str, timeouts: Timeouts) -> None:
    """The node's monitor, in a session of its own (a signal to the ranks' process group does not reach it);
    its stderr is the rank's, so its lines land in the job's log. It detaches (--detach: it forks and the process
    started here exits at once, waited for here), so it is nobody's child: a run called from Python leaves no
    zombie behind when the monitor ends after it (seen: psutil's ZombieProcess in a test that lists children)."""
    subprocess.run([sys.executable, "-m", "megatron_lite.training.watchdog", "--directory", directory, "--detach",
                    *timeouts.argv()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                   close_fds=True, check=False)


@contextlib.contextmanager
def watching(config):
    """The run, watched: this rank reports its progress, local rank 0 starts the node's monitor; on the way out
    (any way this rank leaves by itself) the rank stops reporting and the monitor stops watching it."""
    if not config.watchdog.watchdog:
        yield
        return
    from megatron_lite.training.distributed import environment_from_launcher

    environment_from_launcher()  # the job's identity (MASTER_PORT) names the channel's folder
    directory = progress.channel_directory()
    progress.start(directory, int(os.environ["RANK"]))
    if int(os.environ["LOCAL_RANK"]) == 0:
        start_monitor(directory, Timeouts.from_config(config.watchdog))
    try:
        yield
    finally:
        progress.end()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The node's progress watchdog (started by pretrain_gpt.py).")
    parser.add_argument("--directory", required=True)
    parser.add_argument("--startup", type=float, required=True)
    parser.add_argument("--step", type=float)
    parser.add_argument("--checkpoint", type=float)
    parser.add_argument("--evaluation", type=float)
    parser.add_argument("--factor", type=float, required=True)
    parser.add_argument("--floor", type=float, required=True)
    parser.add_argument("--detach", action="store_true", help="fork; the parent exits 0 at once")
    a = parser.parse_args(argv)
    if a.detach and os.fork():
        os._exit(0)
    return monitor(a.directory, Timeouts(a.startup, a.step, a.checkpoint, a.evaluation, a.factor, a.floor))


if __name__ == "__main__":
    sys.exit(main())
