"""--async-save: the files of a checkpoint are written by a background thread while training goes on.

At a save step every rank copies what it would write into host memory, in the main thread between two
steps (checkpoint/snapshot.py, through EngineIO's deferred save), so the files hold that step's state.
A thread then writes and fsyncs them, and the ranks agree that every rank's files are durable over a gloo
group of their own: the training groups stay the main thread's, and two threads never share a group.
Only then does rank 0 rename the temporary folder and replace `latest`, the commit a synchronous save
makes (checkpointing.py). A process killed before that leaves the previous checkpoint as `latest`.

One save is in flight at a time: the next save waits for it, and so does the end of the run (the last
iteration, --exit-interval, a signal). A failed write is known to every rank's writer (they agreed on it)
and raised in the main thread where every rank waits, at the next save or at the end, so the ranks stop
together.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, List, Optional

import torch.distributed as dist

from megatron_lite.training import progress


def write_in_turn(writes: List[Callable[[], None]], failure: Optional[Exception] = None) -> Optional[Exception]:
    """Each of `writes`, in turn, until one raises WriteError (or while `failure` is None): the first failure,
    or None. Each write is dropped from the list once done, so a snapshot's memory goes back file by file."""
    from megatron_lite.atomic import WriteError

    while writes and failure is None:
        write = writes.pop(0)
        try:
            write()
        except WriteError as e:
            failure = e
        del write
    writes.clear()
    return failure


class AsyncWriter:
    def __init__(self, timeout: Optional[datetime.timedelta] = None):
        """Collective: every rank creates the writer's group."""
        kwargs = {"timeout": timeout} if timeout is not None else {}
        self.group = dist.new_group(backend="gloo", **kwargs)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, tag: str, writes: List[Callable[[], None]], commit: Callable[[Optional[Exception], object], None],
               failure: Optional[Exception] = None) -> None:
        """Start writing: each of `writes` in turn (stopping at the first WriteError), then `commit(failure,
        group)`, which agrees with the other ranks and publishes. The previous save must have been waited for."""
        assert self._thread is None, "wait() for the save in flight before submitting another"
        self._thread = threading.Thread(target=self._run, args=(writes, commit, failure), daemon=True,
                                        name=f"async-save {tag}")
        self._thread.start()

    def _run(self, writes, commit, failure) -> None:
        try:
            progress.maybe_hang_in_finalize(threading.current_thread().name)  # a drill's hook, else nothing
            commit(write_in_turn(writes, failure), self.group)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self._error = e

    def wait(self) -> Optional[float]:
        """Block until the save in flight is committed: the seconds waited, None when none was in flight.
        Raises its failure."""
        if self._thread is None:
            return None
        start = time.perf_counter()
        self._thread.join()
        error, self._error, self._thread = self._error, None, None
        if error is not None:
            raise error
        return time.perf_counter() - start
