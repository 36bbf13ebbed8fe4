"""Reading JSONL corpora: plain, gzip or zstd input, one JSON object per line, bad lines named.

Shared by tools/preprocess_data.py and tools/train_tokenizer.py. No torch here.
"""
from __future__ import annotations

import gzip
import io
import json
from typing import BinaryIO, Iterable, Iterator, List, Sequence, Tuple, Union

GZIP_SUFFIXES = (".gz",)
ZSTD_SUFFIXES = (".zst", ".zstd")
# Named so that such a file is refused instead of being read as (bad) JSON lines.
UNSUPPORTED_SUFFIXES = (".bz2", ".xz", ".lzma", ".lz4", ".zip", ".tar", ".7z", ".br")


class BadLine(ValueError):
    """A line that cannot give a document; str() says why."""


def is_compressed(path: str) -> bool:
    return path.endswith(GZIP_SUFFIXES + ZSTD_SUFFIXES)


def open_input(path: str) -> Tuple[BinaryIO, BinaryIO]:
    """(lines, raw): lines yields bytes lines (decompressed for .gz / .zst); raw.tell() is the position on disk.

    Streaming: memory does not grow with the file. A compressed file that ends
    early raises EOFError (gzip's behaviour, and ours for zstd).
    """
    raw = open(path, "rb")
    if path.endswith(GZIP_SUFFIXES):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(ZSTD_SUFFIXES):
        return io.BufferedReader(ZstdReader(raw), 1 << 20), raw
    return raw, raw


class ZstdReader(io.RawIOBase):
    """Decompresses a .zst file frame after frame (multi-frame files, as pzstd writes, included).

    zstandard's own stream_reader returns a truncated file's prefix without
    complaint; here a file that ends inside a frame raises EOFError. Windows up
    to 2 GiB are accepted (`zstd --long=31`), as corpora are often compressed so.
    """

    def __init__(self, raw: BinaryIO, read_size: int = 1 << 18) -> None:
        import zstandard

        self._decompressor = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._raw = raw
        self._read_size = read_size  # bounds one decompressed block to read_size x the compression ratio
        self._blocks = self._decompressed_blocks()
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _decompressed_blocks(self) -> Iterator[bytes]:
        frame = None
        while True:
            data = self._raw.read(self._read_size)
            if not data:
                if frame is not None:
                    raise EOFError("the file ends inside a zstd frame (truncated?)")
                return
            while data:
                if frame is None:
                    frame = self._decompressor.decompressobj()
                out = frame.decompress(data)
                if out:
                    yield out
                if frame.eof:
                    data, frame = frame.unused_data, None
                else:
                    data = b""

    def readinto(self, buffer) -> int:
        while not len(self._pending):
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._pending = memoryview(block)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def split_lines(block: bytes) -> List[bytes]:
    """The lines of a block of whole lines (as line_blocks cuts them, or one line as readline returns it), without
    their endings, ended the way Python's text mode ends them.

    Text mode (which Megatron-LM reads with) ends a line at \\n, \\r\\n or a bare \\r.
    A block ends just after a \\n (or at the end of the input), so a \\r\\n pair is never cut.
    """
    if not block:
        return []
    if b"\r" in block:
        block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if block.endswith(b"\n"):
        block = block[:-1]
    return block.split(b"\n")


def line_blocks(data: Iterable[bytes], max_lines: int, max_bytes: int) -> Iterator[bytes]:
    """Re-cuts a stream of bytes into blocks of whole lines: each ends just after a \\n (the last may end the input
    instead) and holds at most max_lines lines; a block also ends at the first line end at or past max_bytes."""
    pending = b""   # the stream after the last cut
    waiting = []    # data read since, while it held no newline (a long line: joined once, not copied per read)
    for piece in data:
        if b"\n" not in piece:
            waiting.append(piece)
            continue
        buffer = b"".join([pending, *waiting, piece])
        waiting = []
        position = 0
        while True:
            end = position
            lines = 0
            while lines < max_lines and end - position < max_bytes:
                newline = buffer.find(b"\n", end)
                if newline < 0:
                    break
                end, lines = newline + 1, lines + 1
            if lines < max_lines and end - position < max_bytes:
                break  # the rest holds too few whole lines: wait for more data
            yield buffer[position:end]
            position = end
        pending = buffer[position:]
    rest = b"".join([pending, *waiting])
    if rest:
        yield rest


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
