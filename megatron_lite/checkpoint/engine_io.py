"""Everything DeepSpeed's engine reads from or writes to a checkpoint goes through `EngineIO`.

Reads are served from files the ranks validated beforehand (`preload`), so a bad file is found before any
rank enters a collective that the others would wait in; anything else is still loaded without executing
code. Writes never raise inside DeepSpeed's save (other ranks would wait in its closing barrier for a rank
that left): the first failure is kept, later writes of the save are skipped, and the caller asks every
rank for its failure once DeepSpeed's save has returned everywhere. A deferred save (--async-save) writes
nothing: it keeps a snapshot of each object with its path, for a background writer.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from megatron_lite.atomic import WriteError, describe, torch_save
from megatron_lite.checkpoint.format import load_file
from megatron_lite.checkpoint.snapshot import snapshot
from megatron_lite.deepspeed_compat import checkpoint_files


class EngineIO:
    def __init__(self):
        self._preloaded: Dict[str, Any] = {}
        self.failure: Optional[WriteError] = None
        self.deferred: Optional[List[Tuple[Any, str]]] = None

    def install(self, engine) -> None:
        checkpoint_files.install_checkpoint_io(engine, self)

    def preload(self, path: str, value: Any) -> None:
        """A validated file's content, handed to DeepSpeed when it asks for `path`."""
        self._preloaded[os.path.abspath(path)] = value

    def clear(self) -> None:
        self._preloaded.clear()

    def load(self, path: str) -> Any:
        value = self._preloaded.pop(os.path.abspath(path), None)
        return load_file(path) if value is None else value

    def start_save(self, deferred: bool = False) -> None:
        """A save begins; `deferred`: keep (snapshot, path) pairs in `self.deferred` instead of writing."""
        self.failure = None
        self.deferred = [] if deferred else None

    def save(self, obj: Any, path: str) -> None:
        if self.failure is not None:
            return
        if self.deferred is not None:
            self.deferred.append((snapshot(obj), path))
            return
        try:
            torch_save(obj, path)
        except WriteError as e:
            self.failure = e

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self.failure is not None:
            return
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.failure = WriteError(path, describe(e))
