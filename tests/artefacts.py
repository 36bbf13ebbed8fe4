"""Test inputs that take a training run or a tool chain to make, built once per test run and shared.

`built_once(tmp_path_factory, name, build)` calls build(folder) the first time any pytest-xdist worker
asks for `name` in this run and returns the folder to every later caller, in any worker: the workers
take a file lock in the run's shared temporary folder (pytest's basetemp holds one folder per worker
under it). What is shared is read-only by agreement: a test that changes a checkpoint copies it first
(tests/checkpoint/conftest.py's copy_checkpoint).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from tests.harness import REPO_ROOT


def shared_root(tmp_path_factory) -> Path:
    """This run's temporary folder that every worker sees (basetemp itself without pytest-xdist)."""
    base = Path(tmp_path_factory.getbasetemp())
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, made by build(folder) unless a worker of this run made it already. A build that
    failed leaves no mark, so the next caller builds again (and fails with its own traceback)."""
    root = shared_root(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.write_text("")
    return folder


def run_tool(*args, check: bool = True, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """A script of the checkout (tools/..., pretrain_gpt.py) in a fresh interpreter, as a user runs it."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT, **(env or {}))
    result = subprocess.run([sys.executable, *map(str, args)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=timeout, env=full_env)
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def build_corpus(folder: Path) -> None:
    """A 120-document corpus of Python's own sources, a 400-piece SentencePiece model trained on it, and its
    Megatron-format dataset (folder/corpus_text_document), made with the project's own tools."""
    jsonl = folder / "corpus.jsonl"
    run_tool("tools/make_corpus.py", "--output", jsonl, "--max-docs", "120")
    run_tool("tools/train_tokenizer.py", "--input", jsonl, "--vocab-size", "400", "--model-prefix", folder / "spm")
    run_tool("tools/preprocess_data.py", "--input", jsonl, "--output-prefix", folder / "corpus",
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", folder / "spm.model", "--append-eod",
             "--workers", "1")
