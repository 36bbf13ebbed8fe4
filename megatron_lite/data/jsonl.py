"""Reading JSONL corpora: plain or gzip input, one JSON object per line, bad lines named.

Shared by tools/preprocess_data.py and tools/train_tokenizer.py. No torch here.
"""
from __future__ import annotations

import gzip
import json
from typing import BinaryIO, List, Sequence, Tuple, Union


class BadLine(ValueError):
    """A line that cannot give a document; str() says why."""


def open_input(path: str) -> Tuple[BinaryIO, BinaryIO]:
    """(lines, raw): lines yields bytes lines (decompressed for .gz); raw.tell() is the position in the file on disk."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def physical_lines(raw_line: bytes) -> List[bytes]:
    """Python's text mode (which Megatron-LM reads with) also ends lines at a bare \\r; split the same way."""
    if b"\r" not in raw_line:
        return [raw_line]
    parts = raw_line.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    if not parts[-1]:
        parts.pop()
    return parts


def parse_line(raw_line: bytes, json_keys: Sequence[str]) -> Union[List[str], BadLine]:
    """The texts of json_keys in one line, or a BadLine saying what is wrong (returned, not raised: cheap in bulk)."""
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(f"invalid UTF-8 at byte {e.start}")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadLine(f"invalid JSON ({e})" if line.strip() else "empty line")
    if not isinstance(obj, dict):
        return BadLine(f"a JSON {type(obj).__name__}, not an object")
    texts = []
    for key in json_keys:
        if key not in obj:
            return BadLine(f"no key {key!r}")
        value = obj[key]
        if not isinstance(value, str):
            return BadLine(f"{key!r} is a {type(value).__name__}, not a string")
        if not (value.isascii() or _encodable(value)):
            return BadLine(f"{key!r} holds a lone surrogate (a \\ud800-\\udfff escape), not valid Unicode")
        texts.append(value)
    return texts


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
