"""One table per Hugging Face architecture maps our dense parameters to theirs; this module walks a table
both ways (export: checkpoint/hf_export.py; import: checkpoint/hf_import.py).

An entry names one of our dense (TP = PP = 1) parameters and the Hugging Face tensors it holds, stacked
along dim 0 in order (q, k, v into the fused QKV; gate, up into SwiGLU's first linear). Rows of ours past
the sum of theirs are vocabulary padding: dropped on the way out, zeros on the way in. GPT-2's Conv1D
stores linear weights as [in, out], ours as [out, in]: such entries are `transposed`. Our stacked expert
weights ([E, R, C], every expert of an MoE layer) map to one Hugging Face tensor per expert and projection:
such entries have `experts` E and stack theirs along the flattened [E R, C] (checkpoint/hf_moe.py).
Rotary rows that Hugging Face keeps as interleaved pairs (DeepSeek-V3's rope_interleave) are ours in rotate-half
order, [evens | odds]: such entries name their `rotary` rows, and each walk permutes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

import torch

from megatron_lite.checkpoint.format import CheckpointError

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Mapped:
    """One of our dense parameters and the Hugging Face tensors it holds, stacked along dim 0 in order."""

    ours: str
    shape: Tuple[int, ...]
    """Our tensor's shape."""
    theirs: Tuple[str, ...]
    rows: Tuple[int, ...]
    """dim 0 (ours) of each of theirs (the other dims are ours); rows of ours past their sum are padding."""
    transposed: bool = False
    """Theirs is stored [in, out] (GPT-2's Conv1D)."""
    experts: int = 0
    """Ours is [E, R, C...] and theirs stack along its flattened [E R, C...] (E per-expert tensors); else 0."""
    rotary: Tuple[int, int] = (0, 0)
    """(period, width): the last `width` rows of every `period` rows are rotary pairs, interleaved (x0, y0, x1, y1,
    ..) in theirs and [x0, x1, .., y0, y1, ..] in ours, as RoPE turns them (model/rotary.py rotates halves;
    transformers' apply_rotary_pos_emb_interleave is this permutation, then rotate-half). (0, 0): none. Only
    for entries of one tensor of theirs, without padding."""

    @property
    def flat_shape(self) -> Tuple[int, ...]:
        """The shape theirs are stacked along: ours, with an expert stack's first two dims as one."""
        if not self.experts:
            return self.shape
        return (self.shape[0] * self.shape[1],) + self.shape[2:]

    def their_shape(self, index: int) -> Tuple[int, ...]:
        shape = (self.rows[index],) + self.flat_shape[1:]
        return shape[::-1] if self.transposed else shape


def their_rows(entry: Mapped, start: int, stop: int) -> torch.Tensor:
    """[stop - start] the row of theirs each of our rows start..stop holds (int64)."""
    rows = torch.arange(start, stop)
    period, width = entry.rotary
    if not width:
        return rows
    inside = rows % period - (period - width)  # the row's place among its block's rotary rows; < 0: not rotary
    half = width // 2
    paired = torch.where(inside < half, 2 * inside, 2 * (inside - half) + 1)  # x_j at 2j, y_j at 2j + 1
    return torch.where(inside >= 0, rows - inside + paired, rows)


def _some(names: List[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _source(flags: str) -> str:
    """What gives the shapes, as a refusal names it: `flags` is an export's model flags ("--num-layers, ...") or
    an import's config.json fields (import-hf takes no model flag: hf_import.py's shape_fields)."""
    return f"the model flags ({flags})" if flags.startswith("--") else flags


def check_names(have: Iterable[str], want: Iterable[str], what: str, flags: str) -> None:
    have, want = set(have), set(want)
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        problems = [f"lacks {_some(missing)}"] if missing else []
        problems += [f"has unexpected {_some(extra)}"] if extra else []
        raise CheckpointError(f"{what} {' and '.join(problems)}: it is not the model {_source(flags)} describe")


def check_shape(name: str, actual: Tuple[int, ...], shape: Tuple[int, ...], flags: str) -> None:
    if tuple(actual) != tuple(shape):
        raise CheckpointError(f"{name} is {list(actual)}, the config needs {list(shape)}: {_source(flags)} must "
                              f"describe the same model")


def theirs_of(entry: Mapped, tensor: torch.Tensor, flags: str) -> List[Tuple[str, torch.Tensor]]:
    """Our dense tensor -> its Hugging Face tensors (padding dropped). Pieces of a split tensor are copies
    (safetensors refuses tensors that share memory); a whole tensor is a view."""
    check_shape(entry.ours, tensor.shape, entry.shape, flags)
    if entry.rotary[1]:  # back to interleaved pairs: a new tensor, never a view of ours
        tensor = torch.empty_like(tensor).index_copy_(0, their_rows(entry, 0, tensor.shape[0]), tensor)
    pieces = tensor.reshape(entry.flat_shape)[:sum(entry.rows)].split(entry.rows)
    out = []
    for name, piece in zip(entry.theirs, pieces):
        piece = piece.t() if entry.transposed else piece
        out.append((name, piece.clone() if len(pieces) > 1 or entry.transposed else piece))
    return out


def ours_of(entry: Mapped, read: Callable[[str], torch.Tensor], flags: str) -> torch.Tensor:
    """Our dense tensor from its Hugging Face tensors, read one at a time by name; padding rows are zeros. An
    expert stack's tensors stack along its flattened [E R, C] (the importer fills a stack expert by expert
    instead: hf_import._expert_slice)."""
    pieces = []
    for index, name in enumerate(entry.theirs):
        tensor = read(name)
        check_shape(name, tensor.shape, entry.their_shape(index), flags)
        pieces.append(tensor.t() if entry.transposed else tensor)
    padding = entry.flat_shape[0] - sum(entry.rows)
    if padding:
        pieces.append(pieces[0].new_zeros((padding,) + entry.flat_shape[1:]))
    if entry.rotary[1]:
        return pieces[0].index_select(0, their_rows(entry, 0, entry.shape[0]))
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces).view(entry.shape)


def ours_rows(entry: Mapped, start: int, stop: int, shape_of: Callable[[str], Tuple[int, ...]],
              read_rows: Callable[[str, int, int], torch.Tensor], flags: str) -> torch.Tensor:
    """Rows start..stop of our dense tensor, reading only those rows of the Hugging Face tensors (entries
    stored as ours are, not transposed); rows in the padding are zeros."""
    assert not entry.transposed, "a transposed tensor's rows are its columns: read it whole"
    if entry.rotary[1]:  # the rows of theirs these permute: whole heads' rows keep to the heads' span
        check_shape(entry.theirs[0], shape_of(entry.theirs[0]), entry.their_shape(0), flags)
        rows = their_rows(entry, start, stop)
        low = int(rows.min())
        return read_rows(entry.theirs[0], low, int(rows.max()) + 1).index_select(0, rows - low)
    pieces, offset = [], 0
    for index, name in enumerate(entry.theirs):
        check_shape(name, shape_of(name), entry.their_shape(index), flags)
        lo, hi = max(start, offset), min(stop, offset + entry.rows[index])
        if lo < hi:
            pieces.append(read_rows(name, lo - offset, hi - offset))
        offset += entry.rows[index]
    if stop > offset:
        pieces.append(torch.zeros((stop - max(start, offset),) + entry.shape[1:],
                                  dtype=pieces[0].dtype if pieces else torch.float32))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def to_hf(dense: StateDict, table: List[Mapped], flags: str) -> StateDict:
    """Our whole dense state dict -> the Hugging Face one."""
    check_names(dense, [e.ours for e in table], "the dense state dict", flags)
    return {name: t for e in table for name, t in theirs_of(e, dense[e.ours], flags)}


def from_hf(hf: StateDict, table: List[Mapped], flags: str) -> StateDict:
    """A whole Hugging Face state dict (derived tensors already dropped) -> our dense one."""
    check_names(hf, [n for e in table for n in e.theirs], "the Hugging Face state dict", flags)
    return {e.ours: ours_of(e, hf.__getitem__, flags) for e in table}
