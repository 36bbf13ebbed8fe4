"""Build index arrays once (rank 0), cache them as .npy, memory-map them on every rank.

Files are named by an md5 of a description of everything the arrays depend
on, so a changed input gets new files instead of stale ones. Each array is
written under a temporary name and renamed; the description file goes last
and marks the set complete, so a crash mid-write is rebuilt, never half-read.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict, Sequence, Tuple

import numpy as np
import torch.distributed as dist

from megatron_lite.atomic import WriteError, atomic_file, describe, write_text


def cache_key(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _paths(cache_dir: str, stem: str, names: Sequence[str]) -> Tuple[Dict[str, str], str]:
    return ({name: os.path.join(cache_dir, f"{stem}-{name}.npy") for name in names},
            os.path.join(cache_dir, f"{stem}-description.json"))


def _save(path: str, array: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def load_or_build(cache_dir: str, stem: str, description: dict, names: Sequence[str],
                  build: Callable[[], Dict[str, np.ndarray]]) -> Tuple[Dict[str, np.ndarray], bool]:
    """(arrays memory-mapped read-only, whether this process built them).

    With torch.distributed initialized only rank 0 builds; the others wait at a
    barrier, then map the files (a shared filesystem is assumed across nodes).
    """
    stem = f"{cache_key(description)}-{stem}"
    paths, description_path = _paths(cache_dir, stem, names)
    distributed = dist.is_available() and dist.is_initialized()
    built = False
    failure = None
    if not distributed or dist.get_rank() == 0:
        if not os.path.isfile(description_path) or not all(os.path.isfile(p) for p in paths.values()):
            arrays = build()
            try:
                try:
                    os.makedirs(cache_dir, exist_ok=True)
                except OSError as e:
                    raise WriteError(cache_dir, describe(e)) from None
                for name, path in paths.items():
                    _save(path, arrays[name])
                write_text(description_path, json.dumps(description, indent=2, sort_keys=True))
            except WriteError as e:
                failure = (e.path, e.reason)
            built = True
    if distributed:  # the other ranks wait here for rank 0's files, and learn if it could not write them
        message = [failure]
        dist.broadcast_object_list(message, src=0)
        failure = message[0]
    if failure is not None:
        raise WriteError(*failure)
    if not os.path.isfile(description_path):
        raise FileNotFoundError(f"{description_path}: rank 0 built the indices but this rank cannot see them; "
                                f"--data-cache-path must be on a filesystem every node shares")
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}, built


def mapped_file(array: np.ndarray) -> str:
    """The .npy file an array of load_or_build is mapped from, for another process to map it again."""
    if not isinstance(array, np.memmap) or array.filename is None:
        raise ValueError("not an array mapped by load_or_build: it would travel by value")
    return array.filename
