"""How a command that used torch.distributed ends its process: exit handlers, flushed output, then `os._exit`.

Why not a plain exit: the interpreter's finalization ends any thread that asks for the GIL while it runs
(CPython's take_gil calls pthread_exit), and gloo's worker threads ask for it after the caller has its
result: a finished collective's work is destroyed on the worker thread, and dropping the last reference
to a tensor the caller let go of decrefs its Python object. pthread_exit unwinds through that noexcept
destructor, so the C++ runtime aborts: "terminate called without an active exception", exit -6, after a
run that had printed its result. Seen in a suite run after pretrain_gpt.py refused a bad checkpoint
(core dump: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil ->
PyThread_exit_thread -> std::terminate); reproduced under load by tests/test_process_end.py.
Ending here runs everything a normal exit runs that the run could need (the atexit handlers: DataLoader
workers stopped, multiprocessing's children joined, logging flushed) while the interpreter is still whole,
and skips only the finalization, the one step that kills threads.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import traceback
from typing import Callable, NoReturn, Sequence


def exit_code(code) -> int:
    """What the interpreter makes of sys.exit(code): None is 0, a message is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_process(code: int) -> NoReturn:
    """Exit handlers, then stdout and stderr (Python's and C's) flushed, then the process ends with `code`."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        ctypes.CDLL(None).fflush(None)
        os._exit(code)


def run_then_end(main: Callable[[Sequence[str]], object], argv: Sequence[str]) -> NoReturn:
    """A command's `if __name__ == "__main__"` block: main(argv), and its exit code (its return value or
    sys.exit's) through end_process; an exception that escapes main prints its traceback and exits 1."""
    try:
        code = exit_code(main(argv))
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130  # the shell's code for a command stopped by Ctrl-C
    except BaseException:  # noqa: BLE001 - what the interpreter would print before exiting 1
        traceback.print_exc()
        code = 1
    end_process(code)
