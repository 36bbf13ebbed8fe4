"""Where a tool may write: an output flag's target is new, or replaced only when the user says --overwrite.

Every tool checks its output flags with `target_problem` before it reads or computes anything, so a refusal
(exit 2, one line naming the flag) costs nothing and writes nothing:

- a target that exists is refused unless --overwrite was given (a tokenizer, a dataset, a plan or a
  checkpoint is what later runs record by SHA-256 or read back; replacing one silently loses it);
- a target under a file (corpus.jsonl/out) or of the wrong kind (a folder where a file is written) is
  refused whatever --overwrite says;
- an empty value, or a prefix (PREFIX.bin, PREFIX_text_document.idx) that names a folder, is refused: it
  would write hidden files (".bin") into the current folder or into that one;
- a target whose nearest existing folder cannot be written (a read-only file system) is refused before the
  work whose result could not be kept.

The write itself goes through atomic.py, so an overwrite that is interrupted leaves the previous file or
folder as it was. Torch-free, at the bottom of the imports.
"""
from __future__ import annotations

import errno
import os
from typing import Optional, Sequence

OVERWRITE_HELP = "replace an existing output, which is otherwise refused so that nothing is lost by mistake"


def blocking_file(path: str) -> Optional[str]:
    """The nearest existing parent of `path` when it is not a folder (a file in the way), else None."""
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) else existing


def target_problem(flag: str, value: str, paths: Sequence[str], overwrite: bool, folder: bool = False,
                   empty_folder_is_new: bool = False) -> Optional[str]:
    """Why the tool must not write the output `flag VALUE` names, or None. `paths`: the files (or, with
    `folder`, the folder) the output consists of; `empty_folder_is_new`: an empty folder counts as new."""
    if not value.strip():
        return f"{flag} is empty; give a {'folder' if folder else 'path'} such as {_example(flag, paths, value)}"
    if _is_prefix(value, paths) and (value.endswith(os.sep) or os.path.isdir(value)):
        return (f"{flag} {value} is a folder: its outputs would be hidden files in it ({os.path.basename(paths[0])}); "
                f"give a prefix such as {os.path.join(value, 'data')}")
    for path in paths:
        blocker = blocking_file(path)
        if blocker:
            return (f"{flag} {value} cannot be created: {blocker} is a file; give a path whose parents are "
                    f"folders")
    for path in paths:
        if not os.path.lexists(path):
            continue
        if folder and not os.path.isdir(path):
            return f"{flag} {value} is a file; give a folder (it is created if missing)"
        if not folder and os.path.isdir(path):
            return f"{flag} {value}: {path} is a folder; give a name that is not taken by a folder"
        if folder and empty_folder_is_new and not os.listdir(path):
            continue
        if not overwrite:
            shown = "" if os.path.abspath(path) == os.path.abspath(value) else f" ({path})"
            return (f"{flag} {value} already exists{shown}; give a new {'folder' if folder else 'name'}, or add "
                    f"--overwrite to replace it")
    for path in paths:  # every write, an overwrite's too, goes through a temporary beside the target
        existing = _nearest_existing(os.path.dirname(os.path.abspath(path)))
        reason = not_writable(existing)
        if reason:
            return (f"{flag} {value} cannot be written: {existing} is not writable ({reason}); give a folder this "
                    f"user can write")
    return None


def not_writable(folder: str) -> Optional[str]:
    """Why this user cannot create files in the existing `folder` ("Read-only file system"), or None."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    return os.strerror(errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES)


def _nearest_existing(path: str) -> str:
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def _is_prefix(value: str, paths: Sequence[str]) -> bool:
    """Whether the outputs are `value` with a suffix glued on (PREFIX.bin), not files inside a folder `value`."""
    return bool(paths) and all(p.startswith(value) and len(p) > len(value) and not p[len(value):].startswith(os.sep)
                               for p in paths)


def _example(flag: str, paths: Sequence[str], value: str) -> str:
    if _is_prefix(value, paths):
        return "data/my-corpus"
    return {"--output-dir": "data/synthetic", "--save": "checkpoints/new"}.get(flag, "out/" + (
        os.path.basename(paths[0]) if paths and os.path.basename(paths[0]) else "result"))
