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
    # The forward passes only added to device buffers (router.local_load, step_sums); this is where they are read.
    packed = sum_over_batch(torch.stack([torch.cat([m.router.local_load, m.step_sums]) for m in layers]),
                            sequence_parallel)
    loads = packed[:, :-4]  # [layers, E]
    balance = loads.amax(1) / loads.mean(1).clamp_min(1e-9)
    scalars = torch.cat([packed[:, -4:], balance.unsqueeze(1)], 1).tolist()  # the step's one device-to-host copy
    # Each rank added its share of every micro-batch's router losses, dropped fraction and count (model/moe.py):
    # summed over the batch's ranks, their ratio is the mean over the batch's micro-batches.
    for layer, load, (aux, z, dropped, micro, max_over_mean) in zip(layers, loads, scalars):
        micro = max(micro, 1.0)
        layer.last_step = {"load": load.clone(), "load_max_over_mean": max_over_mean,
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
