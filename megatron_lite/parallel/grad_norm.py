"""Global L2 gradient norm of a model split over TP (and PP) ranks, each parameter counted once.

    ||g||^2 = sum over the replica's ranks of sum over the parameters this rank counts of ||g_p||^2

A rank counts its TP-split parameters (each rank holds a different slice) and
its replicated parameters (LayerNorm, row-parallel bias) only on TP rank 0.
A tied weight's copy on a stage that does not own it (DeepSpeed marks it; see
deepspeed_compat.is_pipe_replicated_copy) is left to the owning stage.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_lite.deepspeed_compat import is_pipe_replicated_copy
from megatron_lite.parallel import state
from megatron_lite.parallel.tp import tp_rank


def counts_toward_grad_norm(param: torch.Tensor) -> bool:
    if is_pipe_replicated_copy(param):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank() == 0


def global_grad_norm(parameters: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """fp32 scalar, the same on every rank of `group` (default: this replica's TP x PP ranks)."""
    params = list(parameters)
    device = params[0].device if params else torch.device("cpu")
    grads = [p.grad.detach() for p in params if p.grad is not None and counts_toward_grad_norm(p)]
    # One multi-tensor norm (torch's clip_grad_norm_ does the same), in fp32 whatever the grads' dtype.
    squared = (torch.nn.utils.get_total_norm([g.float() for g in grads]).to(device) ** 2 if grads
               else torch.zeros((), dtype=torch.float32, device=device))
    if group is None and state.is_initialized():
        group = state.get_model_parallel_group()
    if group is not None:
        dist.all_reduce(squared, group=group)
    return squared.sqrt()
