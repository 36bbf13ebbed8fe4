"""Publishing files and folders atomically: a reader sees the old content or the whole new one, never a part.

Every writer in the project goes through here: checkpoints and converted checkpoints, datasets and their
sidecars, tokenizers, sweep files. The content is written under a temporary name in the same folder
(hidden, unique per process: `.NAME.tmp-HOST-PID-RANDOM`), flushed and fsync'ed, renamed over the final
name, and the folder is fsync'ed so that the rename survives a crash. On any failure (a full disk, a
read-only folder, an exception in the caller) the temporary is removed and a `WriteError` names the final
path and the reason; nothing appears under the final name.

A process killed mid-write leaves its temporary behind. The next write of the same name on the same host
removes temporaries whose process is gone, so they do not pile up.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
from typing import IO, Iterator, Optional

TMP_MARK = ".tmp-"


class WriteError(RuntimeError):
    """A file or folder could not be written; the message names it and says why, in one line."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path
        self.reason = reason


def describe(error: BaseException) -> str:
    """One line for an OSError ('No space left on device') or any other exception."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_").replace("-", "_")


def temporary_name(path: str) -> str:
    """A hidden sibling of `path` that no other process (on any host) picks."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}{TMP_MARK}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str) -> list:
    """Remove temporaries of `path` left by dead processes of this host; returns what was removed."""
    folder, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}{TMP_MARK}{_host()}-"
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        stale = os.path.join(folder, entry)
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(stale)
        removed.append(stale)
    return removed


def fsync_folder(folder: str) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):  # file systems without folder fsync
            raise
    finally:
        os.close(fd)


class _RecordingWriter:
    """A file object that keeps the OSError of a failed write: torch.save reports a full disk as
    'enforce fail at inline_container.cc', so the real reason is taken from here."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()


class AtomicFile:
    """A file being written under a temporary name: `commit()` publishes it, `discard()` drops it.
    For writers that stay open across calls (the indexed-dataset writer); others use `atomic_file`."""

    def __init__(self, path: str, mode: str = "wb", encoding: Optional[str] = None):
        self.path = path
        remove_stale_temporaries(path)
        self.tmp = temporary_name(path)
        try:
            self.file = open(self.tmp, mode, encoding=encoding)
        except OSError as e:
            raise WriteError(path, describe(e)) from None

    def commit(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
            fsync_folder(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            self.discard()
            raise WriteError(self.path, describe(e)) from None

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb", encoding: Optional[str] = None) -> Iterator[IO]:
    """`with atomic_file(path) as f: f.write(...)`: the file appears at `path` only when the block ends
    without an exception. OSErrors (a full disk) become a WriteError naming `path`."""
    target = AtomicFile(path, mode, encoding)
    try:
        yield target.file
    except OSError as e:
        target.discard()
        raise WriteError(path, describe(e)) from None
    except BaseException:
        target.discard()
        raise
    target.commit()


def write_bytes(path: str, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def torch_save(obj, path: str, name: Optional[str] = None) -> None:
    """torch.save into `path`, a file inside a folder that is published as a whole (`atomic_folder`, a
    checkpoint's temporary tag); a full disk is a WriteError naming `name` (default `path`), and the
    partial file is removed. `save_torch` publishes a single file atomically."""
    import torch

    try:
        with open(path, "wb") as f:
            writer = _RecordingWriter(f)
            try:
                torch.save(obj, writer)
                f.flush()
                os.fsync(f.fileno())
            except RuntimeError as e:
                raise (writer.error or e) from None
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise WriteError(name or path, describe(e)) from None


def save_torch(obj, path: str) -> None:
    """torch.save published atomically at `path`."""
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    torch_save(obj, tmp, name=path)
    try:
        os.replace(tmp, path)
        fsync_folder(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise WriteError(path, describe(e)) from None


RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 swaps the two names in one step
AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the names of `a` and `b` atomically (Linux renameat2); False where the system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def _replace_folder(tmp: str, path: str) -> None:
    """Publish folder `tmp` at `path`, which holds a previous folder: swapped in one step where the system can
    (a crash leaves the old folder or the new one at `path`, whole); elsewhere the old one is first renamed
    aside under a name no cleanup removes (`.NAME.replaced-...`), so a crash in between loses nothing."""
    if _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # the previous folder, now under the temporary name
        return
    folder, name = os.path.split(os.path.abspath(path))
    aside = os.path.join(folder, f".{name}.replaced-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(path, aside)
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(path: str, replace: bool = False) -> Iterator[str]:
    """`with atomic_folder(out) as tmp: write files into tmp`: the folder appears at `out`, whole, only
    when the block ends without an exception; `out` must not exist, unless `replace` (an --overwrite), when
    a folder there is replaced by the new one only once the new one is complete. On failure tmp is removed."""
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise WriteError(path, describe(e)) from None
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            fsync_folder(root)
        if replace and os.path.isdir(path):
            _replace_folder(tmp, path)
        else:
            os.rename(tmp, path)
        fsync_folder(os.path.dirname(os.path.abspath(path)))
    except WriteError as e:  # a file inside: name it where it was to appear
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(e.path.replace(tmp, os.path.abspath(path), 1), e.reason) from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(path, describe(e)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
