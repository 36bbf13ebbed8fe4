"""Put tensor-parallel slices together and cut them apart again, as parallel/layers.py cuts them.

The split dimension of the full tensor is made of sections (their full lengths), each cut into
TP equal contiguous pieces, and rank r holds piece r of every section: for the fused QKV,
sections (a hd, g hd, g hd) give rank r [Q_r; K_r; V_r] (parallel/qkv.py); a stride s is s equal
sections; a plain split is one section, whatever its length (a vocabulary padded differently).
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def _pieces(length: int, tp: int) -> int:
    if length % tp:
        raise ValueError(f"a section of {length} along the split dimension does not divide into {tp} TP pieces")
    return length // tp


def merge(slices: Sequence[torch.Tensor], dim: int, sections: Sequence[int]) -> torch.Tensor:
    """The full tensor from every TP rank's slice (rank order); a replicated tensor is rank 0's."""
    if dim < 0 or len(slices) == 1:
        return slices[0]
    tp = len(slices)
    if len(sections) == 1:
        return torch.cat(list(slices), dim=dim)
    per_rank = [torch.split(s, [_pieces(n, tp) for n in sections], dim=dim) for s in slices]
    return torch.cat([per_rank[r][c] for c in range(len(sections)) for r in range(tp)], dim=dim)


def piece(full: torch.Tensor, tp: int, rank: int, dim: int, sections: Sequence[int]) -> torch.Tensor:
    """TP rank `rank`'s slice of the full tensor (a view where it is one piece); a replicated tensor is whole."""
    if dim < 0 or tp == 1:
        return full
    parts = torch.split(full, list(sections), dim=dim) if len(sections) > 1 else (full,)
    pieces = [torch.split(p, _pieces(p.shape[dim], tp), dim=dim)[rank] for p in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def split(full: torch.Tensor, tp: int, dim: int, sections: Sequence[int]) -> List[torch.Tensor]:
    """Every TP rank's slice of the full tensor, each its own copy; a replicated tensor is copied to each rank."""
    return [piece(full, tp, r, dim, sections).clone() for r in range(tp)]
