"""A small tmpfs for disk-full and read-only tests; the test is skipped, with the reason, where none can be
mounted (mounting needs root and the CAP_SYS_ADMIN capability; CI's machines have both)."""
import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size_bytes: int):
    """A tmpfs of `size_bytes` (rounded up to pages) mounted at `path` for the block."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}); disk-full tests "
                    f"need root with CAP_SYS_ADMIN")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def fill(path, leave_bytes: int) -> None:
    """Fill the file system at `path` until about `leave_bytes` are free."""
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    if free > leave_bytes:
        with open(os.path.join(path, "filler"), "wb") as f:
            f.write(b"\0" * (free - leave_bytes))


def listing(path):
    """Every file and folder under `path`, hidden ones included, relative."""
    found = []
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(root, name), path))
    return sorted(found)
