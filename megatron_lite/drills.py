"""Test and drill hooks read from the environment: hangs injected where a real run gets stuck (the progress watchdog's
drills, training/progress.py). Standard library only: validation reads them before torch, and a data worker
hangs with them without importing the trainer.

MEGATRON_LITE_INJECT_HANG=KIND:RANK:ITERATION[@HOST] (comma-separated for several; with @HOST only on that node, by
its short host name), KIND one of deadlock (the rank takes a lock it holds as iteration ITERATION starts),
data_worker (its data worker sleeps forever at the ITERATION-th sample it loads), checkpoint_finalize (its async
save's finalize of iteration ITERATION's checkpoint blocks forever).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import List, Tuple


INJECT_ENV = "MEGATRON_LITE_INJECT_HANG"
INJECT_KINDS = ("deadlock", "data_worker", "checkpoint_finalize")


def host_name() -> str:
    """This node's short host name, as Slurm names nodes (ExcNodeList takes it; the fault log records it)."""
    return socket.gethostname().split(".")[0]


def injected_hangs() -> Tuple[Tuple[str, int, int], ...]:
    """MEGATRON_LITE_INJECT_HANG's (kind, rank, iteration)s; a malformed one raises ValueError naming it."""
    hangs: List[Tuple[str, int, int]] = []
    for item in filter(None, (p.strip() for p in os.environ.get(INJECT_ENV, "").split(","))):
        spec, _, host = item.partition("@")
        kind, *numbers = spec.split(":")
        if kind not in INJECT_KINDS or len(numbers) != 2 or not all(n.isdigit() for n in numbers) or "@" in host:
            raise ValueError(f"{INJECT_ENV} '{item}' must be KIND:RANK:ITERATION[@HOST] with KIND one of "
                             f"{', '.join(INJECT_KINDS)}, e.g. deadlock:1:3 or deadlock:0:3@node17")
        if host and host != host_name():  # a drill of one node (the Slurm test's faulty node)
            continue
        hangs.append((kind, int(numbers[0]), int(numbers[1])))
    return tuple(hangs)


def hang_forever(kind: str) -> None:
    """The drill's hang: a lock taken twice (deadlock, the GIL released as in a real one) or a sleep."""
    if kind == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    while True:
        time.sleep(3600)
