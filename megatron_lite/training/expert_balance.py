"""Once per global batch, each router's load (routed copies per expert summed over the whole batch: every
micro-batch of every rank holding a part of it) is summed in one all-reduce, kept for the metrics, and moves
the expert bias of aux-loss-free balancing (DeepSeek-V3) towards equal load. Runs inside the optimizer step on
every rank of a stage alike, so the biases stay equal across data-, context- and tensor-parallel ranks."""
from __future__ import annotations

import torch

from megatron_lite.parallel.experts import sum_over_batch


def routers(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if hasattr(m, "update_expert_bias")]


def update_expert_biases(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Every router in module: its global load for this batch (`last_load`), then bias += rate x
    sign(mean load - load) where it has a bias; its local count starts again."""
    found = routers(module)
    if not found:
        return  # a pipeline stage without MoE layers: nothing to sum, and its peers have none either
    loads = sum_over_batch(torch.stack([r.local_load for r in found]), sequence_parallel)
    for router, load in zip(found, loads):
        router.update_expert_bias(load)
