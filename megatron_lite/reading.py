"""Reading the files a tool parses: one path that turns every way a file can be unreadable into one line.

A profile, a plan, a config.json, a sidecar, checkpoint metadata, a vocab.json: whatever the user pointed a
flag at may be missing, a folder, unreadable, not UTF-8 (random bytes, a binary file given by mistake) or
not JSON. Each of those becomes an `UnreadableFile` naming the file and what it is not, in one line, which
the caller turns into its own refusal (exit 2) with the flag and the file it expected. Nothing is parsed
that runs code. The counterpart of atomic.py, the one writer; torch-free, at the bottom of the imports.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional


class UnreadableFile(ValueError):
    """A file that cannot be read as what it should be; the message names it and says why, in one line."""


def file_problem(path: str) -> Optional[str]:
    """Why `path` cannot be opened as a file ('no such file', 'is a folder, not a file', ...), or None."""
    if os.path.isdir(path):
        return "is a folder, not a file"
    if not os.path.isfile(path):
        return "no such file"
    if not os.access(path, os.R_OK):
        return "file is not readable (permissions)"
    return None


def _decode_error(e: UnicodeDecodeError) -> str:
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"


def read_text(path: str) -> str:
    """The file's UTF-8 text; UnreadableFile('PATH: no such file' / 'not UTF-8 text (...)' / ...)."""
    why = file_problem(path)
    if why:
        raise UnreadableFile(f"{path}: {why}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: {_decode_error(e)}") from None
    except OSError as e:
        raise UnreadableFile(f"{path}: cannot be read ({e.strerror or e})") from None


def parse_json(text: str, path: str) -> Any:
    """`text` (read from `path`) as JSON; UnreadableFile naming the file and where the JSON breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise UnreadableFile(f"{path}: not JSON this reader can hold (nested too deeply)") from None


def read_json(path: str) -> Any:
    """The file's JSON value, read as UTF-8; UnreadableFile naming the file on any failure."""
    return parse_json(read_text(path), path)
