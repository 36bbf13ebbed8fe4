"""The folders a training run writes (--save, --tensorboard-dir, --data-cache-path), checked before any process
group exists, without creating anything.

A path that is a file, lies under a file, or cannot be created or written is one line naming the flag (exit 2),
instead of a traceback on the rank that first writes there while the other ranks wait for it in a collective.
Training only: tools that validate a checkpoint's saved config do not write to its folders.
"""
from __future__ import annotations

import os
from typing import Optional

from megatron_lite.config import Config, ConfigError, flag_for
from megatron_lite.targets import not_writable as _not_writable

# (section, field) of every flag that names a folder the run writes.
OUTPUT_FOLDERS = (("training", "save"), ("logging", "tensorboard_dir"), ("data", "data_cache_path"))
# An existing --data-cache-path may be read-only: a shared cache whose indices were built beforehand.
MAY_BE_READ_ONLY = ("data_cache_path",)


def check_output_folders(config: Config) -> None:
    """ConfigError naming the first output folder flag whose folder this run could not create or write."""
    for section, name in OUTPUT_FOLDERS:
        path = getattr(getattr(config, section), name)
        problem = path and folder_problem(path, name in MAY_BE_READ_ONLY)
        if problem:
            raise ConfigError(f"{flag_for(name)} {path} {problem}")


def folder_problem(path: str, may_be_read_only: bool = False) -> Optional[str]:
    """What stops a run from creating (if missing) and writing folder `path`, or None."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"is {'a file' if os.path.isfile(path) else 'not a folder'}; give a folder (it is created if missing)"
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is a file; give a path whose parents are folders"
    reason = _not_writable(existing)
    if reason and existing != os.path.abspath(path):
        return f"cannot be created: {existing} is not writable ({reason}); give a folder this user can write"
    if reason and not may_be_read_only:
        return f"is not writable ({reason}); give a folder this user can write"
    return None

