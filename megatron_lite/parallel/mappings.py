"""Autograd collectives that move activations into and out of the tensor-parallel region.

Each mapping is a pair: what forward does, and the transpose that backward
must do so gradients stay correct.

    copy    forward identity     backward all-reduce   (replicated input -> split weights)
    reduce  forward all-reduce   backward identity     (partial sums -> replicated output)
    scatter forward split        backward all-gather   (last dim)
    gather  forward all-gather   backward split        (last dim)

At TP = 1 the public functions return their input unchanged: no autograd
node, no collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel.tp import all_reduce, split_size, tp_group, tp_rank, tp_world_size


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


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

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


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _CopyToModelParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _ReduceFromModelParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _ScatterToModelParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world_size() == 1 else _GatherFromModelParallelRegion.apply(x)
