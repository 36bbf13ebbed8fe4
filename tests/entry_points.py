"""Run a script's main(argv) on N warm harness ranks, as torchrun would run the script on N fresh processes.

`run_entry(["pretrain_gpt.py", *flags], nproc)` returns what `harness.run_launcher` returns (a
CompletedProcess: exit code, stdout, stderr) without a launcher and without N interpreters importing torch
and DeepSpeed: the harness's warm pool of nproc workers runs `main(argv)` of the script (pretrain_gpt.py,
or any of tools/) with the environment variables torchrun sets, the world group already made, and fds 1
and 2 written to files, so C++'s output and the logging handlers' are captured too. Each rank's stdout
follows the one before it (torchrun interleaves them by time). The exit code is the first non-zero one in
rank order, as sys.exit gave it, or 1 with the traceback on stderr for an exception that escaped main.

What a real process adds is not tested here: the launcher, signals, a kill, the interpreter's exit.
The tests about those keep `run_launcher` (docs/getting-started.md, Tests, says which and why).
"""
from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from typing import Dict, Optional, Sequence

from tests import harness

_MODULES: Dict[str, object] = {}


def _load(script: str):
    """The script as a module (imported once per worker): its main is what its `__main__` block calls."""
    path = os.path.join(harness.REPO_ROOT, script)
    if path not in _MODULES:
        name = "entry_" + os.path.splitext(os.path.basename(script))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


class _MayHaveChildren:
    """A harness worker is a daemonic process, and multiprocessing refuses to start children from one; the
    script's own children (DataLoader workers, --num-workers) are its business, as they are under torchrun."""

    def __enter__(self):
        import multiprocessing

        self.config = multiprocessing.current_process()._config
        self.daemon = self.config.get("daemon")
        self.config["daemon"] = False

    def __exit__(self, *exc):
        self.config["daemon"] = self.daemon


class _ProcessState:
    """What a script may change in its process and a warm worker must get back: the environment, the
    working folder, argv, signal handlers, logging levels and handlers, torch's grad mode and default dtype."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGCHLD)

    def __init__(self):
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.signals = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
        self.loggers = [(lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers
                        if isinstance(lg, logging.Logger)]
        self.grad_enabled = torch.is_grad_enabled()
        self.default_dtype = torch.get_default_dtype()

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv = self.argv
        for sig, handler in self.signals.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        known = {id(lg) for lg, *_ in self.loggers}
        for name in list(logging.root.manager.loggerDict):  # loggers the script made: back to defaults
            lg = logging.root.manager.loggerDict[name]
            if isinstance(lg, logging.Logger) and id(lg) not in known:
                lg.setLevel(logging.NOTSET)
                lg.handlers.clear()
        for lg, level, handlers, propagate, disabled in self.loggers:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)


class _CapturedFds:
    """fds 1 and 2 into two files for the duration (Python's, C's and C++'s writes alike)."""

    def __init__(self, out_path: str, err_path: str):
        self.paths = (out_path, err_path)

    def __enter__(self):
        self._flush()
        self.saved = [os.dup(1), os.dup(2)]
        for fd, path in zip((1, 2), self.paths):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        return self

    def __exit__(self, *exc):
        self._flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        ctypes.CDLL(None).fflush(None)  # C stdio's buffers (gloo, DeepSpeed's C++ ops)


def run_main(script: str, argv: Sequence[str], env: Optional[Dict[str, str]], cwd: Optional[str],
             out_dir: str) -> int:
    """On a harness rank: `script`'s main(argv) with this rank's output in out_dir/rank<r>.{out,err};
    returns the exit code."""
    rank = int(os.environ.get("RANK", "0"))
    saved = _ProcessState()
    os.environ.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    os.chdir(cwd or harness.REPO_ROOT)
    sys.argv = [script, *argv]
    try:
        with _CapturedFds(os.path.join(out_dir, f"rank{rank}.out"), os.path.join(out_dir, f"rank{rank}.err")), \
                _MayHaveChildren():
            code = _call_main(script, argv)
            # What the run left open (a lock, a records file, on an error path) is closed when its objects
            # go, as a process's exit would close it: a test may unmount the folder next.
            gc.collect()
            return code
    finally:
        saved.restore()


def _call_main(script: str, argv: Sequence[str]) -> int:
    try:
        return _exit_code(_load(script).main(list(argv)))
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter would print before exiting 1
        traceback.print_exc()
        return 1


def run_entry(script_args: Sequence[str], nproc: int, timeout: float = harness.DEFAULT_TIMEOUT,
              env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """`script_args` (script path first, relative to the checkout) on nproc warm ranks: the CompletedProcess
    `harness.run_launcher` gives for the same arguments. Raises DistributedTestError after `timeout`, or
    when a rank's worker dies. A rank that exits non-zero while others still run gives them a few seconds
    (torchrun stops the rest when one fails), then the pool is replaced."""
    script, *argv = [str(a) for a in script_args]
    out_dir = tempfile.mkdtemp(prefix="entry-")
    pool = harness.warm_pool(nproc)
    try:
        got, errors, missing = pool.collect(run_main, (script, argv, env, cwd, out_dir), {}, timeout,
                                            failed=lambda code: code != 0, grace=10.0)
        outputs = [_read(os.path.join(out_dir, f"rank{r}.{kind}")) for kind in ("out", "err")
                   for r in range(nproc)]
        stdout, stderr = "".join(outputs[:nproc]), "".join(outputs[nproc:])
        if errors or (missing and not any(got.values())):
            raise harness.DistributedTestError(
                f"{' '.join(script_args)} on {nproc} warm ranks: "
                + ("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) or
                   f"ranks {missing} did not finish within {timeout:.0f}s")
                + f"\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}")
        codes = [got[r] for r in sorted(got)] + [1] * len(missing)
        code = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess(list(script_args), code, stdout, stderr)
    finally:
        harness.retire_if_spent(pool)
        shutil.rmtree(out_dir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


# Scripts that import torch: run_script runs them on one warm rank, the same main() the command line runs,
# without 2-3 s of imports each. The data tools import no torch and start in a fraction of a second: they
# run in a fresh interpreter, as the user runs them.
WARM_SCRIPTS = ("pretrain_gpt.py", "tools/convert_checkpoint.py", "tools/evaluate.py", "tools/generate.py",
                "tools/estimate_memory.py")


def run_script(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """A script of the checkout (path relative to it first) with these arguments, as one process: its
    CompletedProcess (exit code, stdout, stderr), not checked."""
    args = [str(a) for a in args]
    if args[0] in WARM_SCRIPTS:
        return run_entry(args, 1, timeout=timeout)
    from tests.artefacts import run_tool

    return run_tool(*args, check=False, timeout=timeout)

