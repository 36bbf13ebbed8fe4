"""This process's place in its tensor-parallel group, and which slice of a split tensor it owns.

Without `parallel.state.initialize()` (a plain process, as when the dense
reference model is built) everything here says TP = 1: size 1, rank 0, no
group, and no collective is ever issued. Every module in `parallel/` asks
these getters instead of `parallel.state`, so one code path serves both.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch
import torch.distributed as dist

from megatron_lite.parallel import state

_as_single_rank = False


def _parallel() -> bool:
    return state.is_initialized() and not _as_single_rank


@contextlib.contextmanager
def as_single_rank():
    """Inside the block everything here says TP = 1, whatever this process's place: for building a layer
    only to read its dense (TP = 1) parameter names and shapes inside a TP > 1 run (checkpoint layouts)."""
    global _as_single_rank
    before, _as_single_rank = _as_single_rank, True
    try:
        yield
    finally:
        _as_single_rank = before


def tp_world_size() -> int:
    return state.get_tensor_model_parallel_world_size() if _parallel() else 1


def tp_rank() -> int:
    return state.get_tensor_model_parallel_rank() if _parallel() else 0


def tp_group():
    return state.get_tensor_model_parallel_group() if _parallel() else None


def split_size(total: int, parts: int, what: str) -> int:
    """total / parts, or an error naming the quantity and sizes that would split evenly."""
    if parts <= 0 or total % parts:
        lower = total // parts * parts if parts > 0 else 0
        raise ValueError(f"{what} {total} is not divisible by {parts}; use a multiple of {parts} "
                         f"such as {lower or parts} or {lower + parts}")
    return total // parts


def partition_range(per_partition: int, rank: int) -> Tuple[int, int]:
    """[start, end) of rank's contiguous slice when every rank holds per_partition entries."""
    start = rank * per_partition
    return start, start + per_partition


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over the TP group; nothing happens at TP = 1."""
    if tp_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=tp_group())
    return tensor
