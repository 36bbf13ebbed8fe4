"""Global L2 gradient norm of a model split over TP (and PP) ranks, each parameter counted once.

    ||g||^2 = sum over the replica's ranks of sum over the parameters this rank counts of ||g_p||^2

A rank counts its TP-split parameters (each rank holds a different slice) and
its replicated parameters (LayerNorm, row-parallel bias) only on TP rank 0.
A tied weight's copy on a stage that does not own it (DeepSpeed marks it; see
deepspeed_compat.pipeline.is_pipe_replicated_copy) is left to the owning stage. Expert parameters (model/moe.py)
hold other experts on each expert-parallel rank: their squares are summed over the EP group first, so
each expert counts once (the bug of Megatron-LM PR #5916 and DeepSpeed #8475 was counting them otherwise).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_lite.deepspeed_compat.pipeline import is_pipe_replicated_copy
from megatron_lite.parallel import state
from megatron_lite.parallel.experts import is_expert_parameter
from megatron_lite.parallel.tp import tp_rank


def counts_toward_grad_norm(param: torch.Tensor) -> bool:
    if is_pipe_replicated_copy(param):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank() == 0


def _squared_norm(grads, device) -> torch.Tensor:
    # One multi-tensor norm (torch's clip_grad_norm_ does the same), in fp32 whatever the grads' dtype.
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nn.utils.get_total_norm([g.detach().float() for g in grads]).to(device) ** 2


def global_grad_norm(parameters: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """fp32 scalar, the same on every rank of `group` (default: this replica's TP x PP ranks)."""
    params = list(parameters)
    device = params[0].device if params else torch.device("cpu")
    counted = [p for p in params if p.grad is not None and counts_toward_grad_norm(p)]
    squared = _squared_norm([p.grad for p in counted if not is_expert_parameter(p)], device)
    if any(is_expert_parameter(p) for p in params):  # the same on every EP rank of a stage: all join the sum
        # Each EP rank holds other experts: their squares add up over the EP group, each expert once.
        expert_squared = _squared_norm([p.grad for p in counted if is_expert_parameter(p)], device)
        if state.is_initialized() and state.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(expert_squared, group=state.get_expert_model_parallel_group())
        squared = squared + expert_squared
    if group is None and state.is_initialized():
        group = state.get_model_parallel_group()
    if group is not None:
        dist.all_reduce(squared, group=group)
    return squared.sqrt()


def clip_to_global_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients so that their global_grad_norm is at most max_norm (torch.nn.utils.clip_grad_norm_'s
    coefficient); the norm before clipping."""
    params = list(parameters)
    norm = global_grad_norm(params)
    if max_norm / (norm + 1e-6) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # multi-tensor scaling
    return norm.item()
