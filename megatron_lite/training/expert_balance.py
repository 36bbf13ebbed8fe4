"""Once per global batch, for every MoE layer: its load (routed copies per expert summed over the whole batch:
every micro-batch of every rank holding a part of it) and its mean aux loss, z-loss and dropped fraction, in one
all-reduce; the load moves the expert bias of aux-loss-free balancing (DeepSeek-V3) towards equal load. Runs
inside the optimizer step on every rank of a stage alike, so the biases stay equal across data-, context- and
tensor-parallel ranks."""
from __future__ import annotations

from typing import Dict

import torch

from megatron_lite.model.moe import MoELayer
from megatron_lite.parallel.experts import sum_over_batch


def moe_layers(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def update_expert_biases(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Every MoE layer in module: `last_step` (load per expert, max/mean load, mean aux and z-loss, dropped
    fraction), then its router's bias += rate x sign(mean load - load) where it has one; the counts restart."""
    layers = moe_layers(module)
    if not layers:
        return  # a pipeline stage without MoE layers: nothing to sum, and its peers have none either
    packed = sum_over_batch(torch.stack([torch.cat([m.router.local_load, m.step_sums]) for m in layers]),
                            sequence_parallel)
    # Each rank added its share of every micro-batch's router losses, dropped fraction and count (model/moe.py):
    # summed over the batch's ranks, their ratio is the mean over the batch's micro-batches.
    for layer, sums in zip(layers, packed):
        load, (aux, z, dropped, micro) = sums[:-4], sums[-4:].tolist()
        micro = max(micro, 1.0)
        layer.last_step = {"load": load.clone(), "load_max_over_mean": float(load.max() / load.mean().clamp_min(1e-9)),
                           "aux_loss": aux / micro, "z_loss": z / micro, "dropped_fraction": dropped / micro}
        layer.router.update_expert_bias(load)
        layer.step_sums.zero_()


def moe_scalars(module: torch.nn.Module) -> Dict[str, float]:
    """This rank's MoE layers' last-step numbers as metrics: moe/layerNN_<name>."""
    out = {}
    for layer in moe_layers(module):
        for name, value in layer.last_step.items():
            if name != "load":
                out[f"moe/layer{layer.layer_number:02d}_{name}"] = value
    return out
