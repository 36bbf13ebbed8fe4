"""Put tensor-parallel slices together and cut them apart again, as parallel/layers.py cuts them.

With stride s the split dimension of the full tensor is cut into s x TP
chunks and rank r holds chunks r, r + TP, ... (for the fused QKV, s = 3:
rank r holds [Q_r; K_r; V_r], whole heads of each).
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def merge(slices: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from every TP rank's slice (rank order); a replicated tensor is rank 0's."""
    if dim < 0 or len(slices) == 1:
        return slices[0]
    tp = len(slices)
    per_rank = [torch.chunk(s, stride, dim=dim) for s in slices]
    return torch.cat([per_rank[r][c] for c in range(stride) for r in range(tp)], dim=dim)


def split(full: torch.Tensor, tp: int, dim: int, stride: int) -> List[torch.Tensor]:
    """Every TP rank's slice of the full tensor; a replicated tensor is copied to each rank."""
    if dim < 0 or tp == 1:
        return [full.clone() for _ in range(tp)]
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return [torch.cat(chunks[r::tp], dim=dim).clone() for r in range(tp)]
