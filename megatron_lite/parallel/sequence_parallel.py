"""Gradients of replicated parameters that see only this rank's sequence shard (or heads), summed over TP.

With --sequence-parallel the LayerNorm weights and biases and the row-parallel biases are
applied to [b, s/tp, h] sequence shards, so each TP rank's gradient covers its own positions
only. Megatron-LM sums them over the TP group once per step, after the last micro-batch's
backward and before the data-parallel reduction (`_allreduce_layernorm_grads` in
finalize_model_grads); so do we, as one flat all-reduce per dtype (training/engine.py runs it
inside DeepSpeed's pipeline step through deepspeed_compat). Afterwards every TP rank holds the
same gradient, the one the dense model computes, so the gradient norm may count it once
(grad_norm.py) and the replicas stay equal.

QK-norm (--qk-layernorm) is the same case along the heads: its weights, shared by every head, are replicated
over TP but each rank applies them to its own heads only (Megatron-LM sums q_layernorm / k_layernorm
gradients in the same all-reduce).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from megatron_lite.parallel.layers import has_partial_gradient
from megatron_lite.parallel.tp import all_reduce, tp_world_size


def partial_gradient_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of module tagged `sequence_parallel` or `shared_by_heads` (parallel/layers.py), in a fixed
    order (the same on every TP rank)."""
    return [p for _, p in sorted(module.named_parameters()) if has_partial_gradient(p)]


@torch.no_grad()
def all_reduce_gradients_over_tp(grads: Sequence[torch.Tensor]) -> None:
    """Sum each gradient over the TP group, in place: one collective per dtype."""
    if tp_world_size() == 1:
        return
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for grad in grads:
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = all_reduce(torch.cat([g.reshape(-1) for g in same]))
        offset = 0
        for grad in same:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
