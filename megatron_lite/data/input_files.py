"""Which bytes of which input files a preprocessing run, or one shard of it, reads.

The input is a list of files in a fixed order (each `--input` argument in the
order given; a glob's matches sorted by code point, so every node and locale
sees the same order). Shard i of N reads the i-th of N contiguous, roughly
equal byte ranges of that list. A boundary inside a plain file moves forward
to the next line start, so one huge .jsonl splits; a compressed file cannot be
entered in the middle, so a boundary inside one moves to its nearer end. The
shards therefore tile the input in order, and concatenating their outputs in
shard order gives what one run over the whole input gives. No torch here.
"""
from __future__ import annotations

import bisect
import hashlib
import glob
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence

from megatron_lite.data.jsonl import UNSUPPORTED_SUFFIXES, is_compressed, open_input

_GLOB_CHARACTERS = set("*?[")


class InputError(ValueError):
    """An --input that names no usable file; the message says which and why."""


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by --input arguments (paths or globs), in order; a file named twice is an error."""
    files: List[str] = []
    for pattern in patterns:
        if _GLOB_CHARACTERS & set(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise InputError(f"--input {pattern!r} matches no file")
        elif os.path.isdir(pattern):
            raise InputError(f"--input {pattern} is a folder; give its files or a glob such as "
                             f"'{os.path.join(pattern, '*.jsonl.zst')}'")
        elif not os.path.isfile(pattern):
            raise InputError(f"--input {pattern}: no such file")
        else:
            matches = [pattern]
        for path in matches:
            if path.endswith(UNSUPPORTED_SUFFIXES):
                raise InputError(f"--input {path}: compression {os.path.splitext(path)[1]} is not supported; "
                                 f"use plain .jsonl, .jsonl.gz or .jsonl.zst")
            files.append(path)
    seen = set()
    for path in files:
        key = os.path.realpath(path)
        if key in seen:
            raise InputError(f"--input {path} is named twice; its documents would be written twice")
        seen.add(key)
    return files


def input_fingerprint(files: Sequence[str]) -> str:
    """Same for every shard of one run: file names (without folders, which may be mounted elsewhere) and sizes."""
    listing = "".join(f"{os.path.basename(p)}\t{os.path.getsize(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of one file on disk; a compressed file is always whole."""

    path: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def label(self, line_number: int) -> str:
        """Where a line is, for messages: a true line number only when the piece starts the file."""
        if self.start == 0:
            return f"{self.path}:{line_number}"
        return f"{self.path}: line {line_number} after byte {self.start}"


def whole_files(files: Sequence[str]) -> List[Piece]:
    return [Piece(p, 0, os.path.getsize(p)) for p in files]


def shard_pieces(files: Sequence[str], num_shards: int, shard_index: int) -> List[Piece]:
    """The pieces shard `shard_index` of `num_shards` reads, in input order (possibly none)."""
    if not 0 <= shard_index < num_shards:
        raise InputError(f"--shard-index {shard_index} is outside [0, --num-shards {num_shards})")
    sizes = [os.path.getsize(p) for p in files]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    total = starts[-1]

    def boundary(k: int) -> int:
        # Where shard k begins, as a global byte offset; a monotone function of k.
        target = k * total // num_shards
        if k == 0 or k == num_shards or target >= total:
            return 0 if k == 0 else total
        j = bisect.bisect_right(starts, target) - 1
        local, size = target - starts[j], sizes[j]
        if is_compressed(files[j]):
            return starts[j] + (0 if 2 * local < size else size)
        return starts[j] + next_line_start(files[j], local, size)

    begin, end = boundary(shard_index), boundary(shard_index + 1)
    pieces = []
    for path, file_start, size in zip(files, starts, sizes):
        lo, hi = max(begin, file_start), min(end, file_start + size)
        if lo < hi:
            pieces.append(Piece(path, lo - file_start, hi - file_start))
    return pieces


def next_line_start(path: str, offset: int, size: int, block: int = 1 << 16) -> int:
    """The first offset >= `offset` at which a line starts (just after a newline), or the file size."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        position = offset - 1
        while position < size:
            data = f.read(block)
            if not data:
                break
            found = data.find(b"\n")
            if found >= 0:
                return position + found + 1
            position += len(data)
    return size


class PieceReader:
    """The bytes of one piece, and how many of its bytes on disk have been consumed (for progress)."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self._lines, self._raw = open_input(piece.path)
        self._consumed = 0
        if piece.start:
            self._raw.seek(piece.start)

    def blocks(self, size: int) -> Iterator[bytes]:
        """The piece's bytes (decompressed, for a compressed file) in reads of up to `size` bytes."""
        remaining = None if self.piece.start == 0 and self.piece.end == os.fstat(self._raw.fileno()).st_size \
            else self.piece.size  # a plain file's range: it ends at a line start
        while remaining is None or remaining > 0:
            data = self._lines.read(size if remaining is None else min(size, remaining))
            if not data:
                return
            if remaining is not None:
                remaining -= len(data)
            yield data

    def consumed(self) -> int:
        return min(self._raw.tell() - self.piece.start, self.piece.size)

    def close(self) -> None:
        self._lines.close()
        self._raw.close()

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
