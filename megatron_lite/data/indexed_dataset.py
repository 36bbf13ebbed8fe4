"""Megatron-format indexed datasets: a `.bin` of token ids and an `.idx` that locates them.

The layout is /work/shared/FORMATS.md's, byte for byte, so that Megatron-LM,
Megatron-DeepSpeed and GPT-NeoX read what we write and we read theirs. No torch
here: tools/preprocess_data.py imports this module and must start fast.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import struct
from typing import Iterable, Optional, Sequence

import numpy as np

from megatron_lite.atomic import AtomicFile, WriteError, describe, temporary_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, N sequences, D + 1 document-index entries
HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that does not follow the format; the message names the file and the problem."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron-LM's choice: uint16 while every id fits with room to spare, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetWriter:
    """Appends documents to `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Both files are written under temporary names and renamed only when
    complete (megatron_lite/atomic.py), so an interrupted run never leaves a
    half file under the final name. Sequence lengths and document ends go to
    scratch files as they arrive and are streamed into the .idx at the end, so
    memory stays flat however many documents a corpus has. A failed write (a
    full disk) removes every temporary and raises WriteError naming the file.
    As a context manager it finalizes on success and removes the temporary
    files on an exception.
    """

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"{prefix}: token dtype {self.dtype} has no code in the format; use uint16 or int32")
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._bin = self._lengths = self._document_ends = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            self._bin = AtomicFile(data_file_path(prefix))
            self._lengths = open(temporary_name(index_file_path(prefix) + ".lengths"), "w+b")
            self._document_ends = open(temporary_name(index_file_path(prefix) + ".documents"), "w+b")
            self._document_ends.write(np.zeros(1, dtype="<i8").tobytes())
        except (OSError, WriteError) as e:
            self.abort()
            raise WriteError(data_file_path(prefix), getattr(e, "reason", None) or describe(e)) from None

    @contextlib.contextmanager
    def _writing(self, path: str):
        """Any failure to write is the whole dataset's: remove every temporary, name `path`."""
        try:
            yield
        except OSError as e:
            self.abort()
            raise WriteError(path, describe(e)) from None

    def add_document(self, tokens: Sequence[int], sequence_lengths: Optional[Sequence[int]] = None) -> None:
        """One document: its tokens, split into sequences of the given lengths (default: one sequence)."""
        array = np.asarray(tokens, dtype=self.dtype)
        if sequence_lengths is None:
            sequence_lengths = [len(array)] if len(array) else []
        lengths = np.asarray(sequence_lengths, dtype=np.int32)
        if int(lengths.sum()) != len(array):
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())} but the document has {len(array)} tokens")
        self._append(array.tobytes(), lengths, np.array([self.num_sequences + len(lengths)], dtype=np.int64))

    def add_documents(self, token_bytes: bytes, document_lengths: np.ndarray) -> None:
        """Many single-sequence documents at once: their tokens already packed in this writer's dtype.

        A zero length is an empty document: a document-index entry, no sequence.
        """
        document_lengths = np.asarray(document_lengths, dtype=np.int64)
        if int(document_lengths.sum()) * self.dtype.itemsize != len(token_bytes):
            raise ValueError(f"{len(token_bytes)} bytes do not hold {int(document_lengths.sum())} "
                             f"{self.dtype} tokens")
        nonempty = document_lengths > 0
        ends = self.num_sequences + np.cumsum(nonempty, dtype=np.int64)
        self._append(token_bytes, document_lengths[nonempty].astype(np.int32), ends)

    def add_index(self, prefix: str, block: int = 1 << 22) -> None:
        """Append every document of another dataset with the same dtype (merging), a block at a time."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{index_file_path(prefix)}: dtype {other.dtype} differs from "
                                      f"{self.dtype} of {self.prefix}; merge datasets of one tokenizer")
        with self._writing(data_file_path(self.prefix)):
            for start in range(0, len(other), block):
                lengths = other.sequence_lengths[start:start + block]
                self._lengths.write(lengths.astype("<i4").tobytes())
                self.num_tokens += int(lengths.sum(dtype=np.int64))
            for start in range(1, len(other.document_indices), block):
                ends = self.num_sequences + other.document_indices[start:start + block].astype(np.int64)
                self._document_ends.write(ends.astype("<i8").tobytes())
            self.num_sequences += len(other)
            self.num_documents += other.num_documents
            with open(data_file_path(prefix), "rb") as f:
                shutil.copyfileobj(f, self._bin.file, 16 << 20)

    def _append(self, token_bytes: bytes, lengths: np.ndarray, document_ends: np.ndarray) -> None:
        with self._writing(data_file_path(self.prefix)):
            self._bin.file.write(token_bytes)
            self._lengths.write(lengths.astype("<i4").tobytes())
            self._document_ends.write(document_ends.astype("<i8").tobytes())
        self.num_sequences += len(lengths)
        self.num_documents += len(document_ends)
        self.num_tokens += int(lengths.sum(dtype=np.int64))

    def finalize(self, block: int = 1 << 22) -> None:
        index_path = index_file_path(self.prefix)
        index = None
        try:
            index = AtomicFile(index_path)
            self._write_index(index.file, block)
        except (OSError, WriteError) as e:
            if index is not None:
                index.discard()
            self.abort()
            raise WriteError(index_path, getattr(e, "reason", None) or describe(e)) from None
        self._remove_scratch()
        try:
            self._bin.commit()
        except WriteError:
            index.discard()
            raise
        try:
            index.commit()
        except WriteError:  # the pair appears whole or not at all
            os.remove(data_file_path(self.prefix))
            raise

    def _write_index(self, f, block: int) -> None:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], self.num_sequences,
                            self.num_documents + 1))
        self._lengths.seek(0)
        shutil.copyfileobj(self._lengths, f, 16 << 20)
        # Pointers: the byte offset of each sequence, a running sum of the lengths carried across blocks.
        self._lengths.seek(0)
        offset = 0
        while True:
            lengths = np.frombuffer(self._lengths.read(4 * block), dtype="<i4").astype(np.int64)
            if not len(lengths):
                break
            ends = np.cumsum(lengths) + offset
            f.write(((ends - lengths) * self.dtype.itemsize).astype("<i8").tobytes())
            offset = int(ends[-1])
        self._document_ends.seek(0)
        shutil.copyfileobj(self._document_ends, f, 16 << 20)

    def _remove_scratch(self) -> None:
        for scratch in (self._lengths, self._document_ends):
            if scratch is None:
                continue
            scratch.close()
            if os.path.exists(scratch.name):
                os.remove(scratch.name)

    def abort(self) -> None:
        if self._bin is not None:
            self._bin.discard()
        self._remove_scratch()

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader. `ds[i]` is sequence i; `ds.get(i, offset, length)` a slice of it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        index_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (index_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file; write the dataset with tools/preprocess_data.py")
        index_size = os.path.getsize(index_path)
        if index_size < HEADER.size:
            raise IndexedDatasetError(f"{index_path}: {index_size} bytes is shorter than the "
                                      f"{HEADER.size}-byte header (truncated file?)")
        self._index = np.memmap(index_path, dtype=np.uint8, mode="r")
        magic, version, code, n, d1 = HEADER.unpack_from(self._index, 0)
        if magic != MAGIC:
            raise IndexedDatasetError(f"{index_path}: magic {magic!r} is not {MAGIC!r}; not a Megatron .idx file")
        if version != VERSION:
            raise IndexedDatasetError(f"{index_path}: version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{index_path}: dtype code {code} is not one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER.size + 4 * n + 8 * n + 8 * d1
        if index_size != expected:
            raise IndexedDatasetError(
                f"{index_path}: {index_size} bytes, but a header of {n} sequences and {d1} document-index "
                f"entries needs {expected} (truncated or corrupt)")
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(self._index, dtype="<i4", count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = np.frombuffer(self._index, dtype="<i8", count=n, offset=offset)
        offset += 8 * n
        self.document_indices = np.frombuffer(self._index, dtype="<i8", count=d1, offset=offset)
        self._check_against_data(bin_path, index_path, n, d1)
        self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if os.path.getsize(bin_path) else np.zeros(0, np.uint8)

    def __getstate__(self) -> dict:
        """The prefix only: a DataLoader worker maps the files again (data/workers.py spawns workers;
        pickling the maps would copy the whole .bin and .idx through a pipe)."""
        return {"prefix": self.prefix, "path": os.path.abspath(self.prefix)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
        self.prefix = state["prefix"]

    def _check_against_data(self, bin_path: str, index_path: str, n: int, d1: int) -> None:
        if d1 < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexedDatasetError(f"{index_path}: document indices must run from 0 to the sequence count {n}")
        if n and np.any(np.diff(self.document_indices) < 0):
            raise IndexedDatasetError(f"{index_path}: document indices decrease")
        if n and (self.sequence_lengths.min() < 0 or self.sequence_pointers[0] != 0):
            raise IndexedDatasetError(f"{index_path}: negative sequence length or first pointer not 0")
        bin_size = os.path.getsize(bin_path)
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if end > bin_size:
            raise IndexedDatasetError(
                f"{bin_path}: {bin_size} bytes, but {index_path} places sequences up to byte {end} "
                f"(truncated .bin, or .idx of another dataset)")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {index} of "
                             f"length {size}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)


def merge_datasets(output_prefix: str, input_prefixes: Iterable[str]) -> IndexedDataset:
    """Concatenate datasets (same dtype) in the given order into one .bin/.idx pair."""
    prefixes = list(input_prefixes)
    if not prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
    return IndexedDataset(output_prefix)
