"""Where a tool may write: an output flag's target is new, or replaced only when the user says --overwrite.

Every tool checks its output flags with `target_problem` before it reads or computes anything, so a refusal
(exit 2, one line naming the flag) costs nothing and writes nothing:

- a target that exists is refused unless --overwrite was given (a tokenizer, a dataset, a plan or a
  checkpoint is what later runs record by SHA-256 or read back; replacing one silently loses it);
- a target under a file (corpus.jsonl/out) or of the wrong kind (a folder where a file is written) is
  refused whatever --overwrite says.

The write itself goes through atomic.py, so an overwrite that is interrupted leaves the previous file or
folder as it was. Torch-free, at the bottom of the imports.
"""
from __future__ import annotations

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
    return None
