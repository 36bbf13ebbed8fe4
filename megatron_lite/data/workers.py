"""DataLoader worker processes: how they start, which signals they take, how they end with their trainer.

Workers only read data: killing one loses nothing, while a worker that outlives its trainer (or
never delivers its first batch) holds a Slurm allocation or a CI job forever.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing.context
import os
import signal
import sys
import weakref
from multiprocessing import resource_tracker


# The signals the trainer turns into "save and stop" (training/loop.py, --exit-signal-handler).
TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ignore_trainer_signals(worker_id: int) -> None:
    """Slurm signals every process of a job step (`scancel -s USR1`, `--signal=USR1@T`), data workers
    included. A worker killed by it takes the trainer down before it can save, so workers ignore these
    signals; they still stop with the trainer (end_with_trainer)."""
    for sig in TRAINER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TRAINER_SIGNALS)


def end_with_trainer(trainer_pid: int) -> None:
    """PyTorch's worker stops when its parent changes, comparing with the parent it sees when its loop
    starts: a worker whose trainer died while it started (a spawned worker takes seconds) would see init
    and run forever. So the kernel kills the worker when the trainer goes (Linux; strictly, when the
    trainer's thread that started it ends: build_data_iterator runs on the main thread), and a worker
    that starts orphaned ends now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer_pid:  # after prctl: a trainer gone before it is caught here
        os._exit(0)


def _tied_to_trainer(trainer_pid: int, cls):
    """The first thing a new worker unpickles (its Process object's constructor, before the Process's own
    state: the dataset, the loop that imports torch): it ends with its trainer from here on. Tied only in
    init_worker, a worker whose trainer died while it imported torch lived on until the import was done,
    a second and a half on an idle 2-core VM and, in one full test suite, over 30 s."""
    end_with_trainer(trainer_pid)
    return cls.__new__(cls)


class _TrainerBoundProcess(multiprocessing.context.SpawnProcess):
    """A spawned DataLoader worker that ties itself to its trainer as it starts (_tied_to_trainer)."""

    def __reduce__(self):
        # Pickled by the trainer when it spawns the worker: os.getpid() is the trainer's.
        return _tied_to_trainer, (os.getpid(), type(self)), self.__dict__


# How workers start. Not fork: the trainer runs threads by then (gloo's, DeepSpeed's, TensorBoard's), and a
# lock one of them holds at the fork stays locked forever in the child, whose first batch then never comes
# (one short run in ~40 hung so; tests/data/test_data_worker_start.py). Not forkserver: its workers are the
# server's children, PyTorch's workers watch their parent, and the server waits for its workers, so a
# SIGKILLed trainer leaves them running for good. spawn fork+execs a fresh interpreter per worker, a child
# of the trainer: about 1.1-1.3 s to the first batch (mostly `import torch`), once per run as the workers
# persist, against 0.03 s for fork (2 cores; forkserver 1.3 s), and 150 MiB of its own against 15 MiB.
class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _TrainerBoundProcess


def init_worker(trainer_pid: int, worker_id: int) -> None:
    """DataLoader worker_init_fn (bound to the trainer's pid)."""
    ignore_trainer_signals(worker_id)
    end_with_trainer(trainer_pid)
    _drill_hang()


def _drill_hang() -> None:
    """MEGATRON_LITE_INJECT_HANG=data_worker:RANK:N (training/progress.py): this worker of rank RANK sleeps forever
    at the N-th sample it loads, as a worker stuck on storage would. Patched on the class, in this process only."""
    from megatron_lite.drills import hang_forever, injected_hangs

    rank = int(os.environ.get("RANK", "0"))
    hangs = [n for kind, r, n in injected_hangs() if kind == "data_worker" and r == rank]
    if not hangs:
        return
    import torch.utils.data

    cls = type(torch.utils.data.get_worker_info().dataset)
    original, loaded = cls.__getitem__, [0]

    def getitem(self, index):
        loaded[0] += 1
        if loaded[0] >= hangs[0]:
            hang_forever("data_worker")
        return original(self, index)

    cls.__getitem__ = getitem


def _stop_workers(iterator_ref, workers) -> None:
    """At exit: the orderly shutdown while the iterator lives, then SIGKILL for any worker left.

    Workers ignore SIGTERM, which is all PyTorch's own shutdown and multiprocessing's exit hook
    send when a worker does not stop in time; such a worker would live on, and multiprocessing
    would then wait for it forever at interpreter exit."""
    iterator = iterator_ref()
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if any(worker.is_alive() for worker in workers):
        # PyTorch's SIGCHLD handler would raise for each worker killed here; nothing needs it at exit.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)


def stop_workers(iterator) -> None:
    """The run is over: its iterator's workers stopped now, as at interpreter exit (_stop_workers), so that
    a run called from Python leaves no process behind. An iterator without workers: nothing to do."""
    _stop_workers(lambda: iterator, list(getattr(iterator, "_workers", ())))


def loader_options() -> dict:
    """The DataLoader arguments that say how its workers start."""
    return {"multiprocessing_context": _WorkerContext(), "worker_init_fn": functools.partial(init_worker, os.getpid())}


def start_workers(loader):
    """iter(loader) for a loader built with loader_options(), its workers stopped at interpreter exit."""
    # Workers start blocking these signals (exec keeps the mask), so none can die of one between its
    # start and ignore_trainer_signals; so does multiprocessing's resource tracker (in the job step's
    # process group too), which the workers' queues need. Starting the tracker unblocks SIGTERM in this
    # thread (CPython's bpo-33613 fix), so it starts first and the signals are blocked again after it.
    # The trainer gets any that arrived meanwhile.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, TRAINER_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, TRAINER_SIGNALS)
        iterator = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # At interpreter exit PyTorch leaves live workers to multiprocessing, which stops them with
    # SIGTERM, now ignored, and would wait for them forever. Stop them first (atexit runs this
    # before the hooks torch and multiprocessing registered earlier). The worker list is held
    # strongly: an iterator that is gone may have left a worker behind.
    atexit.register(_stop_workers, weakref.ref(iterator), list(getattr(iterator, "_workers", ())))
    return iterator
