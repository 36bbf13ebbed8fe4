"""Autograd collectives that move activations into and out of the tensor-parallel region.

Each mapping is a pair: what forward does, and the transpose that backward
must do so gradients stay correct.

    copy    forward identity     backward all-reduce   (replicated input -> split weights)
    reduce  forward all-reduce   backward identity     (partial sums -> replicated output)
    scatter forward split        backward all-gather   (last dim)
    gather  forward all-gather   backward split        (last dim)

Sequence parallelism (--sequence-parallel) splits the residual stream along the
sequence, dim 1 of our batch-first [b, s, h] activations, into [b, s/tp, h]:

    scatter to seq     forward split        backward all-gather  (embedding output -> shards)
    reduce-scatter     forward reduce-scatter backward all-gather (row-parallel partial sums -> shards)
    gather from seq    forward all-gather   backward reduce-scatter: fused into the column-parallel
                       linear that consumes it (layers.py), so backward keeps only the shard

Grouped-query attention with fewer key/value groups than TP ranks gathers weight rows (dim 0):

    gather rows        forward all-gather   backward reduce-scatter (K/V weight shards -> the whole K/V
                       weight; backward sums each shard's gradient over the ranks that used it)

A reduce-scatter plus an all-gather move the bytes of the all-reduce they replace.
Dim 1 is not the outermost dim: each collective runs on a [tp, b, s/tp, h] buffer
(one extra copy of the activation when b > 1, a view when b = 1) instead of moving
the whole model to sequence-first [s, b, h] as Megatron-LM does.

At TP = 1 the public functions return their input unchanged: no autograd
node, no collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel.tp import all_reduce, split_size, tp_group, tp_rank, tp_world_size

# torch 2.13 calls them *_single and warns on the *_tensor names, the only ones earlier releases have.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce(x: torch.Tensor) -> torch.Tensor:
    # all_reduce works in place; a copy keeps the caller's tensor (maybe saved for backward) intact.
    return all_reduce(x.clone(memory_format=torch.contiguous_format))


def _split_along_last_dim(x: torch.Tensor) -> torch.Tensor:
    # [..., n] -> [..., n/tp], this rank's contiguous slice
    size = split_size(x.size(-1), tp_world_size(), "last dimension")
    return x.narrow(-1, tp_rank() * size, size).contiguous()


def _gather_along_last_dim(x: torch.Tensor) -> torch.Tensor:
    # [..., n/tp] -> [..., n], rank order along the last dim
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_world_size())]
    dist.all_gather(parts, x, group=tp_group())
    return torch.cat(parts, dim=-1)


def split_along_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] -> [b, s/tp, ...], this rank's contiguous part of the sequence (no autograd node)."""
    size = split_size(x.size(1), tp_world_size(), "sequence length")
    return x.narrow(1, tp_rank() * size, size).contiguous()


def gather_along_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s/tp, ...] -> [b, s, ...], rank order along the sequence (no autograd node)."""
    world = tp_world_size()
    stacked = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(stacked, x.contiguous(), group=tp_group())
    parts = stacked.view((world,) + tuple(x.shape))  # [tp, b, s/tp, ...]
    return parts.movedim(0, 1).reshape((x.size(0), world * x.size(1)) + tuple(x.shape[2:]))


def reduce_scatter_along_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] partial sums -> [b, s/tp, ...], this rank's part of the sum over TP (no autograd node)."""
    world = tp_world_size()
    size = split_size(x.size(1), world, "sequence length")
    parts = x.unflatten(1, (world, size)).movedim(1, 0).contiguous()  # [tp, b, s/tp, ...]
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, parts.flatten(0, 1), group=tp_group())  # rank r gets the sum of parts[r]
    return out


class _GatherRowsFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = torch.empty((tp_world_size() * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=tp_group())  # [tp * n, ...], rank order
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous()
        out = torch.empty((grad_output.size(0) // tp_world_size(),) + tuple(grad_output.shape[1:]),
                          dtype=grad_output.dtype, device=grad_output.device)
        _reduce_scatter_single(out, grad_output, group=tp_group())
        return out


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # Eager: the input itself. In a compiled layer (model/compile.py) a copy: AOTAutograd hands a graph output
        # that aliases the graph's input out again as a view of that input, without this Function's backward, so
        # where a graph break follows (the MoE dispatch at EP > 1) the gradient skipped TP's all-reduce (measured:
        # the input gradient 66% off at TP 2 x EP 2; tests/model/test_compile.py).
        return x.clone() if torch.compiler.is_compiling() else x

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_along_last_dim(x)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_along_last_dim(x)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return split_along_sequence(x)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_sequence(grad_output)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_along_sequence(x)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_sequence(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return gather_along_sequence(x)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter_along_sequence(grad_output)


def gather_from_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """[b, s/tp, ...] -> [b, s, ...] for layers whose output is partial over TP (the MoE experts): backward
    sums the gradient over TP and keeps this rank's part of the sequence."""
    return x if tp_world_size() == 1 else _GatherFromSequenceParallelRegion.apply(x)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _CopyToModelParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _ReduceFromModelParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _ScatterToModelParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _GatherFromModelParallelRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h] replicated -> [b, s/tp, h], this rank's part of the sequence."""
    return x if tp_world_size() == 1 else _ScatterToSequenceParallelRegion.apply(x)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h] partial sums over TP -> [b, s/tp, h] of the sum."""
    return x if tp_world_size() == 1 else _ReduceScatterToSequenceParallelRegion.apply(x)


def gather_rows_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] on each rank -> [tp * n, ...] in rank order; backward sums each rank's rows over TP."""
    return x if tp_world_size() == 1 else _GatherRowsFromModelParallelRegion.apply(x)
