"""One writer per --save folder: a lock held by the run's rank 0 from start to exit.

Two runs saving into one folder (a resubmitted job while the old one still runs, a copied script) would
delete each other's unfinished saves and publish folders holding a mix of both runs' files. The lock is an
flock on `--save/.megatron_lite.lock`; the kernel releases it when its process dies, however it dies. The
file also records who holds it (host, pid, start time, Slurm job), so a refused run can name the holder,
and a run that finds a record but gets the lock knows the previous holder died without releasing it.

flock works on local file systems and on NFS (Linux emulates it with POSIX locks there); a file system
that has no locks (Lustre mounted without -o flock) gets a warning and no lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Optional

from megatron_lite.checkpoint.format import LOCK_FILE, CheckpointError


@dataclass
class Acquired:
    note: Optional[str]
    """A line to print: a stale lock taken over, or locks unsupported; None when nothing happened."""


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "slurm_job": os.environ.get("SLURM_JOB_ID")}


def _describe(record: dict) -> str:
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}{job}"


def _read_record(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        record = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


class SaveFolderLock:
    """`acquire()` once at start (rank 0); the lock lives until `release()` or the process ends."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> Acquired:
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"--save {self.folder}: cannot create {self.path} ({e.strerror}); give a "
                                  f"writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read_record(fd)
            os.close(fd)
            who = _describe(record) if record else "a process that has not recorded itself yet"
            raise CheckpointError(f"--save {self.folder} is in use by another run ({who}); two runs saving into "
                                  f"one folder would tear each other's checkpoints: stop that run or give this "
                                  f"one another --save") from None
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                return Acquired(f"warning: --save {self.folder}: this file system has no locks ({e.strerror}); "
                                f"make sure no other run saves into this folder")
            raise
        previous = _read_record(fd)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(_holder()) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        if previous:
            return Acquired(f"--save {self.folder}: took over the lock of a run that ended without releasing it "
                            f"({_describe(previous)})")
        return Acquired(None)

    def release(self) -> None:
        """Clear the record (a later run then sees a clean release) and drop the lock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
