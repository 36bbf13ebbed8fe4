"""Each rank's progress, told to the node's watchdog (training/watchdog.py) through a channel that needs no Python.

A rank writes one fixed-width line to its own file at every phase boundary: pid, iteration, phase, when the
phase began (CLOCK_MONOTONIC, which every process of a node shares) and, per phase, how often it ended and its
longest time. One `pwrite` of an open file: no collective, no host sync, about 10 us. The watchdog reads the
files; a rank stopped, deadlocked or stuck in C leaves its last line there.

Two handlers the kernel runs without the rank's Python:
- STACK_SIGNAL (SIGUSR2; TERM/USR1 are the trainer's exit signals, data/workers.py TRAINER_SIGNALS): faulthandler
  writes every thread's Python stack to the rank's stack file.
- EXIT_SIGNAL: libc's `_exit` itself is the handler, so the rank ends with exit code = the signal's number
  (exit_codes.EXIT_HANG) even when its Python never runs again; the launcher (srun) passes that code on.

Test and drill hook: MEGATRON_LITE_INJECT_HANG (megatron_lite/drills.py) stops a rank where a real run gets stuck.
"""
from __future__ import annotations

import ctypes
import faulthandler
import functools
import getpass
import hashlib
import os
import re
import signal
import tempfile
import time
from typing import Dict, Iterator, Optional, Tuple

from megatron_lite.exit_codes import EXIT_HANG
from megatron_lite.atomic import write_text
from megatron_lite.drills import hang_forever, injected_hangs

PHASES = ("startup", "data", "forward_backward", "optimizer", "checkpoint", "evaluation")
ENDED = "ended"
"""The phase a rank writes when it leaves the run by any way of its own: the watchdog stops watching it."""
STACK_SIGNAL = signal.SIGUSR2
EXIT_SIGNAL = EXIT_HANG
assert signal.SIGRTMIN <= EXIT_SIGNAL <= signal.SIGRTMAX, "the exit code must be a real-time signal's number"
RECORD_BYTES = 256
DIRECTORY_ENV = "MEGATRON_LITE_WATCHDOG_DIR"


def channel_directory() -> str:
    """The node's folder for this job's progress and stack files, the same for every rank of the job on the node
    without any communication: from the job's identity in the launcher's environment."""
    if os.environ.get(DIRECTORY_ENV):
        return os.environ[DIRECTORY_ENV]
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    job = "|".join(os.environ.get(k, "") for k in keys)
    digest = hashlib.sha1(job.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"megatron_lite_watchdog-{getpass.getuser()}", digest)


def progress_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.progress")


def stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.stack")


def format_record(pid: int, iteration: int, phase: str, since: float, counts: Dict[str, int],
                  longest: Dict[str, float]) -> bytes:
    fields = [str(pid), str(iteration), phase, f"{since:.3f}"]
    fields += [f"{counts.get(p, 0)}:{longest.get(p, 0.0):.3f}" for p in PHASES]
    line = " ".join(fields)
    return (line + " " * (RECORD_BYTES - 1 - len(line)) + "\n").encode()


def parse_record(data: bytes) -> Optional[Tuple[int, int, str, float, Dict[str, Tuple[int, float]]]]:
    """(pid, iteration, phase, since, {phase: (count, longest)}), or None for a line being written (torn)."""
    try:
        fields = data.decode().split()
        pid, iteration, phase, since = int(fields[0]), int(fields[1]), fields[2], float(fields[3])
        seen = {}
        for name, field in zip(PHASES, fields[4:4 + len(PHASES)], strict=True):
            count, longest = field.split(":")
            seen[name] = (int(count), float(longest))
        return pid, iteration, phase, since, seen
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _exit_on_signal(signum: int) -> None:
    """The kernel calls the handler as handler(signum); with libc's _exit as the handler that is _exit(signum):
    async-signal-safe, on whichever thread takes the signal, with the GIL held by anyone or no one."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, ctypes.cast(libc._exit, ctypes.c_void_p).value)


class Progress:
    """One rank's channel to the watchdog. `phase()` is the hot call."""

    def __init__(self, directory: str, rank: int, hangs: Tuple[Tuple[str, int, int], ...] = ()):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.rank, self.pid = directory, rank, os.getpid()
        self.iteration, self.current, self.since = 0, "startup", time.monotonic()
        self.counts: Dict[str, int] = {}
        self.longest: Dict[str, float] = {}
        self._hangs = [h for h in hangs if h[1] == rank]
        self._stack_file = open(stack_path(directory, rank), "w")
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        _exit_on_signal(EXIT_SIGNAL)
        path = progress_path(directory, rank)
        # The first line published whole (the watchdog never sees half of it), then rewritten in place.
        write_text(path, format_record(self.pid, self.iteration, self.current, self.since, self.counts,
                                       self.longest).decode())
        self._fd = os.open(path, os.O_WRONLY)

    def _write(self) -> None:
        os.pwrite(self._fd, format_record(self.pid, self.iteration, self.current, self.since, self.counts,
                                          self.longest), 0)

    def phase(self, name: str, iteration: Optional[int] = None) -> str:
        """Enter phase `name` (at `iteration`, when given); the phase it left, for `during` to go back to."""
        now, left = time.monotonic(), self.current
        self.counts[left] = self.counts.get(left, 0) + 1
        self.longest[left] = max(self.longest.get(left, 0.0), now - self.since)
        self.current, self.since = name, now
        if iteration is not None:
            self.iteration = iteration
        self._write()
        if self._hangs and iteration is not None:
            _inject("deadlock", self._hangs, iteration)
        return left

    def end(self) -> None:
        """The rank leaves the run on its own: unwatched, its files gone."""
        self.current = ENDED
        self._write()
        os.close(self._fd)
        faulthandler.unregister(STACK_SIGNAL)
        self._stack_file.close()
        for path in (progress_path(self.directory, self.rank), stack_path(self.directory, self.rank)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


_progress: Optional[Progress] = None


def start(directory: str, rank: int) -> Progress:
    global _progress
    _progress = Progress(directory, rank, injected_hangs())
    return _progress


def end() -> None:
    global _progress
    if _progress is not None:
        _progress.end()
        _progress = None


def phase(name: str, iteration: Optional[int] = None) -> None:
    """Mark a phase boundary; nothing without a watchdog."""
    if _progress is not None:
        _progress.phase(name, iteration)


class during:
    """`with progress.during("checkpoint"):` the phase for the block, then the one before it."""

    def __init__(self, name: str):
        self.name, self.left = name, None

    def __enter__(self):
        if _progress is not None:
            self.left = _progress.phase(self.name)

    def __exit__(self, *exc):
        if _progress is not None and self.left is not None:
            _progress.phase(self.left)


def in_phase(name: str):
    """A decorator: the function runs in phase `name`."""
    def wrap(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with during(name):
                return function(*args, **kwargs)
        return wrapper
    return wrap


def data_phases(iterator: Iterator) -> Iterator:
    """The iterator, each next() in phase data and forward_backward after it."""
    if _progress is None:
        return iterator
    return _DataPhases(iterator)


class _DataPhases:
    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        phase("data")
        try:
            return next(self.iterator)
        finally:
            phase("forward_backward")


def mark_optimizer_steps(optimizer) -> None:
    """The optimizer's step is phase optimizer (torch's public step hooks, so any wrapper's step is counted)."""
    optimizer.register_step_pre_hook(lambda *_: phase("optimizer"))
    optimizer.register_step_post_hook(lambda *_: phase("forward_backward"))


def _inject(kind: str, hangs, iteration: int) -> None:
    if (kind, hangs[0][1], iteration) in hangs:
        hang_forever(kind)


def maybe_hang(kind: str, rank: int, iteration: int) -> None:
    """A hook for the places a drill can stop (the data worker, the async save's finalize)."""
    if (kind, rank, iteration) in injected_hangs():
        hang_forever(kind)


def maybe_hang_in_finalize(thread_name: str) -> None:
    """The async save's finalize thread ('async-save iter_0000003', training/async_save.py): the drill's hang."""
    if _progress is not None and any(kind == "checkpoint_finalize" for kind, _, _ in _progress._hangs):
        iteration = int(re.sub(r"\D", "", thread_name) or 0)
        maybe_hang("checkpoint_finalize", _progress.rank, iteration)
