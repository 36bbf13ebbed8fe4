"""Context parallelism (--context-parallel-size C, --cp-comm-type a2a): this rank's place in its CP group,
and the two all-to-alls of DeepSpeed-Ulysses-style attention.

Outside attention a CP rank holds s/C consecutive tokens of every sample of its micro-batch. Attention
needs every token, but each head is independent, so one all-to-all trades the sequence split for a head
split (each rank then holds all s tokens of 1/C of its TP rank's heads), the attention runs as if
unsplit, and a second all-to-all trades back:

    heads_to_sequence   [b, n, s/C, hd] -> [b, n/C, s, hd]    backward: sequence_to_heads
    sequence_to_heads   [b, n/C, s, hd] -> [b, n, s/C, hd]    backward: heads_to_sequence

Rank c sends its chunk of heads j to rank j and receives rank j's tokens of its own heads: the
chunks arrive in rank order, which is sequence order because rank j holds the j-th part of it.
Each all-to-all moves (C-1)/C of the tensor; `seconds()` counts the time spent in them, forward and
backward, for the per-stage timing breakdown.

Without `parallel.state.initialize()`, or at C = 1, everything here says CP = 1 and issues no
collective.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_lite.parallel import state

_seconds = 0.0


def context_parallel_groups(local_groups: int, cp: int) -> int:
    """Key/value groups a TP rank sends through the all-to-all, which gives each CP rank 1/cp of them: its
    own, or each repeated for the ranks whose query heads use it when there are fewer than cp (cp is then a
    multiple of them: validation). The one rule the attention (model/attention.py) and the memory
    estimate (cost/activations.py) share."""
    return max(local_groups, cp)


def cp_world_size() -> int:
    return state.get_context_parallel_world_size() if state.is_initialized() else 1


def cp_rank() -> int:
    return state.get_context_parallel_rank() if state.is_initialized() else 0


def cp_group():
    return state.get_context_parallel_group() if state.is_initialized() else None


def seconds() -> float:
    """Seconds spent in CP all-to-alls by this process so far (forward and backward), outside compiled layers:
    in a compiled layer (--compile) the exchange is part of the graph and not timed apart."""
    return _seconds


def _all_to_all(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [C, ...]: chunk j goes to rank j; the result's chunk j came from rank j."""
    global _seconds
    if torch.compiler.is_compiling():  # inside a compiled layer's graph: no host clock to read (model/compile.py)
        return _exchange(chunks)
    start = time.perf_counter()
    out = _exchange(chunks)
    _seconds += time.perf_counter() - start
    return out


def _exchange(chunks: torch.Tensor) -> torch.Tensor:
    chunks = chunks.contiguous()  # first: empty_like keeps a view's strides, all_to_all writes densely
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=cp_group())
    return out


def _heads_to_sequence(x: torch.Tensor) -> torch.Tensor:
    b, n, s, hd = x.shape
    c = cp_world_size()
    chunks = x.reshape(b, c, n // c, s, hd).transpose(0, 1)  # [C, b, n/C, s/C, hd]: head chunk j for rank j
    parts = _all_to_all(chunks)  # [C, b, n/C, s/C, hd]: rank j's tokens of our heads
    return parts.permute(1, 2, 0, 3, 4).reshape(b, n // c, c * s, hd)


def _sequence_to_heads(x: torch.Tensor) -> torch.Tensor:
    b, n, s, hd = x.shape
    c = cp_world_size()
    chunks = x.reshape(b, n, c, s // c, hd).permute(2, 0, 1, 3, 4)  # [C, b, n, s/C, hd]: tokens of rank j
    parts = _all_to_all(chunks)  # [C, b, n, s/C, hd]: our tokens of rank j's heads
    return parts.transpose(0, 1).reshape(b, c * n, s // c, hd)


class _Exchange(torch.autograd.Function):
    """One all-to-all exchange whose backward is the inverse exchange of the gradient: the two mappings
    below are each other's transpose, so one autograd node serves both directions."""

    @staticmethod
    def forward(ctx, x, exchange, inverse):
        ctx.inverse = inverse
        return exchange(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.inverse(grad), None, None


def heads_to_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, n, s/C, hd] (n heads, this rank's tokens) -> [b, n/C, s, hd] (heads c*n/C.., every token)."""
    return _Exchange.apply(x, _heads_to_sequence, _sequence_to_heads) if cp_world_size() > 1 else x


def sequence_to_heads(x: torch.Tensor) -> torch.Tensor:
    """[b, n/C, s, hd] -> [b, n, s/C, hd]: the inverse of heads_to_sequence."""
    return _Exchange.apply(x, _sequence_to_heads, _heads_to_sequence) if cp_world_size() > 1 else x
