"""One TP rank's slice of a parameter, read from memory-mapped checkpoint files without holding the rest.

A saved parameter exists as one flat piece per source TP rank (its slice, row-major), itself stored whole (a
layer file, an AdamW moment) or as consecutive fragments in the DP ranks' ZeRO files (`Flat`). A target TP
rank's slice is cut out of those pieces as parallel/layers.py cuts the full tensor (slicing.py: sections
along the split dimension, each split in TP equal parts), for any source and target TP:

- split along dim 0 (column-parallel weights, the vocabulary, fused QKV and SwiGLU sections): runs of whole
  rows, each contiguous in one source piece;
- split along dim 1 (row-parallel weights): the same columns of every row, copied through a strided view of
  the mapping in blocks of rows (only the pages holding those columns are touched: all of them when a row's
  part is smaller than a page);
- replicated: source rank 0's piece;
- an MoE layer's experts [E, a, b] split along dim 1 or 2: as E matrices, each expert's rows in turn.

Every copy out of a mapped file gives the copied pages back (madvise DONTNEED; a private file mapping
re-reads them if touched again), so a rank's resident memory grows by the slices it keeps and one block,
not by the files it maps. Padded vocabulary rows past the saved ones read as zeros.
"""
from __future__ import annotations

import ctypes
import math
import mmap
from typing import List, Optional, Sequence, Tuple

import torch

PAGE = mmap.PAGESIZE
BLOCK_BYTES = 8 << 20  # source bytes spanned at a time by a strided (dim 1) copy
_MADV_DONTNEED = 4
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
except (OSError, AttributeError):  # not Linux: pages stay resident until the file is unmapped
    _madvise = None


def release(tensor: torch.Tensor) -> None:
    """Give back the resident pages lying wholly inside a memory-mapped tensor's bytes. Only for tensors of
    a private file mapping (torch.load(mmap=True)): on anonymous memory this would zero the data."""
    if _madvise is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr()
    first = -(-start // PAGE) * PAGE
    last = (start + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if last > first:
        _madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


class Flat:
    """One source TP rank's slice of a tensor, flattened: consecutive 1-D pieces (DP fragments, or the
    whole tensor), memory-mapped (`mapped`: their pages are given back once copied) or in memory."""

    def __init__(self, pieces: Sequence[torch.Tensor], mapped: bool):
        self.pieces = [p.reshape(-1) for p in pieces]
        self.starts = [0]
        for p in self.pieces:
            self.starts.append(self.starts[-1] + p.numel())
        self.mapped = mapped
        self.dtype = self.pieces[0].dtype

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop) of the flattened slice, copied."""
        out = torch.empty(stop - start, dtype=self.dtype)
        self._copy(out, start, stop)
        return out

    def _copy(self, out: torch.Tensor, start: int, stop: int) -> None:
        for piece, a in zip(self.pieces, self.starts):
            lo, hi = max(start, a), min(stop, a + piece.numel())
            if lo >= hi:
                continue
            source = piece[lo - a:hi - a]
            out[lo - start:hi - start].copy_(source)
            if self.mapped:
                release(source)

    def read_columns(self, first_row: int, last_row: int, width: int, column: int, count: int) -> torch.Tensor:
        """Columns [column, column + count) of rows [first_row, last_row) of the slice seen as rows of
        `width`, copied: only those bytes, through a strided view of each piece (the pages they lie on are
        touched, the rest of the rows' pages are not); a row that a DP fragment boundary cuts is copied
        by its contiguous column range."""
        out = torch.empty(last_row - first_row, count, dtype=self.dtype)
        i = first_row
        while i < last_row:
            index = next(k for k in range(len(self.pieces)) if i * width < self.starts[k + 1])
            piece, a = self.pieces[index], self.starts[index]
            whole = min(last_row, (a + piece.numel()) // width) - i  # rows from i that lie in this piece
            if whole >= 1 and i * width >= a:
                rows = piece[i * width - a:(i + whole) * width - a].view(whole, width)
                out[i - first_row:i - first_row + whole] = rows[:, column:column + count]
                if self.mapped:
                    release(rows)
                i += whole
            else:
                self._copy(out[i - first_row], i * width + column, i * width + column + count)
                i += 1
        return out


Run = Tuple[Optional[int], int, int]  # (source TP rank or None for zero rows, start along the split dim, length)


def _runs(lengths: Sequence[int], source_tp: int, tp: int, rank: int, target_lengths: Sequence[int]) -> List[Run]:
    """Where target rank `rank`'s part of each section lies in the source pieces, along the split dimension.

    Section c has `lengths[c]` entries saved and `target_lengths[c]` in the target (more: zero padding rows;
    fewer: rows dropped); source rank s holds part s of every section, one after the other."""
    runs: List[Run] = []
    for c, (saved, wanted) in enumerate(zip(lengths, target_lengths)):
        part, source_part = wanted // tp, saved // source_tp
        lo, hi = rank * part, (rank + 1) * part  # in section coordinates
        before = sum(n // source_tp for n in lengths[:c])  # offset of section c inside a source piece
        x = lo
        while x < hi:
            if x >= saved:
                runs.append((None, 0, hi - x))
                break
            s = x // source_part
            n = min(hi, (s + 1) * source_part, saved) - x
            runs.append((s, before + x - s * source_part, n))
            x += n
    return runs


def rank_slice(shape: Sequence[int], dim: int, sections: Sequence[int], sources: Sequence[Flat], tp: int, rank: int,
               rows: Optional[int] = None) -> torch.Tensor:
    """TP rank `rank` of `tp`'s slice of a saved tensor of full `shape` split along `dim` in `sections` (full
    lengths; () for one), from every source TP rank's flat piece; `rows`: the vocabulary's padded rows in the
    target (dim 0, one section), when they differ from the saved ones."""
    shape = tuple(shape)
    if dim < 0:
        return sources[0].read(0, sources[0].numel).view(shape)
    lengths = tuple(sections) or (shape[dim],)
    targets = lengths if rows is None else (rows,)
    runs = _runs(lengths, len(sources), tp, rank, targets)
    width = sum(n for _, _, n in runs)
    dtype = sources[0].dtype
    if len(shape) == 3 and dim == 2:  # experts [E, a, b] split by columns: the rows of all experts are alike
        return rank_slice((shape[0] * shape[1], shape[2]), 1, sections, sources, tp, rank).view(shape[0], shape[1], -1)
    if len(shape) == 3 and dim == 1:  # experts [E, a, b] split by rows: each expert's runs of rows in turn
        inner, source_rows = shape[2], sum(lengths) // len(sources)
        parts = [sources[s].read((e * source_rows + a) * inner, (e * source_rows + a + n) * inner)
                 for e in range(shape[0]) for s, a, n in runs]
        return torch.cat(parts).view(shape[0], width, inner)
    if dim == 0:
        inner = math.prod(shape[1:])
        parts = [torch.zeros(n * inner, dtype=dtype) if s is None else sources[s].read(a * inner, (a + n) * inner)
                 for s, a, n in runs]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view((width,) + shape[1:])
    if dim != 1 or len(shape) != 2:
        raise ValueError(f"a tensor of shape {shape} split along dimension {dim}: only matrices split along 0 or 1")
    out = torch.empty(shape[0], width, dtype=dtype)
    source_width = sum(n // len(sources) for n in lengths)
    block = max(1, BLOCK_BYTES // (source_width * sources[0].pieces[0].element_size()))
    column = 0
    for s, a, n in runs:
        for i in range(0, shape[0], block):
            j = min(shape[0], i + block)
            out[i:j, column:column + n] = sources[s].read_columns(i, j, source_width, a, n)
        column += n
    return out
