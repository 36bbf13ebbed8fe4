"""Aux-loss-free expert balancing (DeepSeek-V3): once per global batch, each router's expert bias moves towards
equal load, the load being its routed copies per expert summed over the whole batch (every micro-batch of
every rank that holds a part of it). Runs inside the optimizer step on every rank of a stage alike, so
the biases stay equal across data-parallel, context-parallel and tensor-parallel ranks."""
from __future__ import annotations

import torch

from megatron_lite.parallel.experts import sum_over_batch


def update_expert_biases(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Every router in module: bias += rate x sign(mean load - load); also restarts its load count."""
    for router in [m for m in module.modules() if hasattr(m, "update_expert_bias")]:
        load = sum_over_batch(router.local_load, sequence_parallel) if router.expert_bias is not None else None
        router.update_expert_bias(load)
