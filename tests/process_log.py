"""TEST_PROCESS_LOG=FILE: one JSON line per process a test starts, for the map of where the suite's time goes.

Each line: the test (PYTEST_CURRENT_TEST), what was started (`kind`: torchrun, deepspeed, a tool's name,
python, a worker pool, ...), how many ranks, and its wall seconds from start to reaped.
`benchmarks/bench_test_startup.py --log FILE` prices each kind's start-up and splits every file's time
into start-up and work. Appending lines is safe across pytest-xdist workers (O_APPEND, one write each).
"""
from __future__ import annotations

import json
import os
import subprocess
import time

VARIABLE = "TEST_PROCESS_LOG"


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def record(kind: str, ranks: int = 1, seconds: float = 0.0, argv=None, test=None) -> None:
    path = os.environ.get(VARIABLE)
    if not path:
        return
    line = json.dumps({"test": test or _current_test(), "kind": kind, "ranks": ranks, "seconds": round(seconds, 3),
                       "argv": [str(a) for a in (argv or [])][:8]}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def classify(argv) -> tuple:
    """(kind, ranks) of a command line."""
    args = [str(a) for a in argv]
    if not args:
        return "other", 1
    ranks = 1
    for flag in ("--nproc_per_node", "--num_gpus"):
        if flag in args:
            ranks = int(args[args.index(flag) + 1])
    if "torch.distributed.run" in args:
        return "torchrun", ranks
    if "deepspeed.launcher.runner" in args:
        return "deepspeed", ranks
    base = os.path.basename(args[0])
    if base.startswith("python"):
        script = next((a for a in args[1:] if a.endswith(".py")), None)
        if "-c" in args:
            return "python -c", 1
        if "-m" in args:
            return "python -m " + args[args.index("-m") + 1], 1
        return (os.path.basename(script) if script else "python"), 1
    return base, 1


def install() -> None:
    """Wrap subprocess.Popen so every child of this process is logged when it is reaped."""
    if not os.environ.get(VARIABLE) or getattr(subprocess.Popen, "_process_log", False):
        return
    original_init = subprocess.Popen.__init__
    original_exit = subprocess.Popen._handle_exitstatus

    def init(self, args, *a, **kw):
        self._log_start = time.monotonic()
        self._log_test = _current_test()
        self._log_argv = [args] if isinstance(args, (str, bytes)) else list(args)
        original_init(self, args, *a, **kw)

    def handle_exitstatus(self, *a, **kw):
        result = original_exit(self, *a, **kw)
        start = getattr(self, "_log_start", None)
        if start is not None:
            kind, ranks = classify(self._log_argv)
            record(kind, ranks, time.monotonic() - start, self._log_argv, self._log_test)
            self._log_start = None
        return result

    subprocess.Popen.__init__ = init
    subprocess.Popen._handle_exitstatus = handle_exitstatus
    subprocess.Popen._process_log = True
