"""The optimizer DeepSpeed wraps around ours: the inner optimizer, loss scale and skipped steps, its partition
files read by parameter, its flat partitions, and master weights, moments, loss scaler and step counters set
in a live engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer we passed in, under DeepSpeed's fp16 / bf16 / ZeRO wrapper (if any).
    Why: our ClippedAdamW records the gradient norm it clipped with."""
    return getattr(optimizer, "optimizer", optimizer)


def loss_scale(optimizer) -> Optional[float]:
    """The current fp16 loss scale, or None without loss scaling. DeepSpeed's fp16 optimizers
    expose it as the `loss_scale` property (the `cur_scale` attribute is gone since 0.18.6)."""
    value = getattr(optimizer, "loss_scale", None)
    return None if value is None else float(value)


def skipped_steps(engine) -> int:
    """Optimizer steps DeepSpeed skipped after an fp16 overflow, over the run (the engine's counter,
    saved in its checkpoints)."""
    return int(getattr(engine, "skipped_steps", 0))


# Optimizer state by parameter: read out of DeepSpeed's partition files and written into a live engine, so a
# checkpoint moves to any TP / PP / DP, ZeRO 0 or 1 and precision (checkpoint/layout_free.py).


@dataclass
class PartitionFragments:
    """One DP rank's optimizer partition file, by parameter: flat fragments of the fp32 master and the Adam
    moments (a parameter split over DP ranks has a fragment in each, in DP-rank order), the step of each
    parameter's group, and the loss scaler's state (plain values)."""
    fragments: Dict[str, Dict[str, Optional[torch.Tensor]]]
    steps: Dict[str, Optional[float]]
    loss_scaler: Optional[Dict[str, object]]


def partition_fragments(state: dict) -> PartitionFragments:
    """Why: ZeRO 1/2 (zero/stage_1_and_2.py) and the bf16 optimizer (bf16_optimizer.py) save flat,
    DP-partitioned fp32 buffers: `single_partition_of_fp32_groups[g]` (the master), `base_optimizer_state`
    (the torch optimizer's state of those flat buffers, one per group: exp_avg, exp_avg_sq, step) and
    `param_slice_mappings[g]` (parameter name -> fragment_address(numel, start) in this rank's partition)."""
    saved = state["optimizer_state_dict"]
    masters = saved["single_partition_of_fp32_groups"]
    base = saved["base_optimizer_state"]
    per_group = base["state"] if isinstance(base, dict) else dict(enumerate(base))
    fragments, steps = {}, {}
    for group, mapping in enumerate(saved["param_slice_mappings"]):
        moments = per_group.get(group, {})
        step = moments.get("step")
        for name, address in mapping.items():
            def piece(flat):
                return None if flat is None else flat.narrow(0, address.start, address.numel)
            fragments[name] = {"fp32": piece(masters[group]), "exp_avg": piece(moments.get("exp_avg")),
                               "exp_avg_sq": piece(moments.get("exp_avg_sq"))}
            steps[name] = None if step is None else float(step)
    scaler = saved.get("loss_scaler")
    return PartitionFragments(fragments, steps, None if scaler is None else dict(vars(scaler)))


def _low_precision_groups(optimizer):
    return getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)


def own_loader_reads(optimizer_name: str, zero_stage: int) -> bool:
    """Whether DeepSpeed's load_checkpoint reads back the optimizer state it saved for this optimizer
    (deepspeed_config.deepspeed_optimizer's name). Why not always: at ZeRO 0, DeepSpeed 0.19's engine hands
    BF16_Optimizer.load_state_dict the one state dict of the model-states file, which indexes it as a list by
    DP rank (`state_dict_list[dp_rank]`): KeyError 0, so a bf16 ZeRO 0 run could not resume at its own layout.
    Such a checkpoint goes through the layout-free path, which reads the partition files DeepSpeed also wrote
    (training/checkpointing.py)."""
    return not (optimizer_name == "BF16_Optimizer" and zero_stage == 0)


@dataclass
class FlatPartition:
    """One optimizer group as ZeRO 1/2 or DeepSpeed's bf16 optimizer hands it to our torch optimizer: a flat
    fp32 buffer holding this DP rank's fragments of the group's parameters, cut over `group`."""
    params: List[torch.nn.Parameter]
    """Every parameter of the group (this TP rank's shard, whole), in order: the other DP ranks hold the rest."""
    fragments: Dict[int, Tuple[int, int, int]]
    """id(parameter) -> (start in the parameter's flattened values, count, start in the flat buffer), for each
    parameter with a fragment in this rank's buffer."""
    group: object
    """The process group the partition is cut over (DP, or expert-DP for an expert group)."""


def optimizer_partitions(optimizer) -> Dict[int, FlatPartition]:
    """Group index -> its FlatPartition, when DeepSpeed partitions the groups (ZeRO 1/2, the bf16 optimizer);
    {} when our optimizer holds the parameters themselves. Why: Muon orthogonalises whole matrices
    (training/muon.py), and these flat buffers cut matrices anywhere; each low-precision parameter's
    `_hp_mapping` (set by DeepSpeed's link_hp_params) says which part of it lies where in this rank's buffer,
    and `real_dp_process_group[g]` over which ranks the rest lies. Mind that ZeRO 1/2 step our optimizer one
    group at a time, showing it that group alone as `param_groups` (`_optimizer_step(group_no)`): inside a
    step, a group's index is not its place here; its flat buffer is."""
    lp_groups = _low_precision_groups(optimizer)
    if lp_groups is None:
        return {}
    partitions = {}
    for index, lps in enumerate(lp_groups):
        fragments = {}
        for lp in lps:
            mapping = lp._hp_mapping
            if mapping is not None:  # None: no fragment of this parameter in this DP rank's partition
                src, dst = mapping.lp_fragment_address, mapping.hp_fragment_address
                fragments[id(lp)] = (src.start, src.numel, dst.start)
        partitions[index] = FlatPartition(list(lps), fragments, optimizer.real_dp_process_group[index])
    return partitions


def set_master_weights(engine, values: Dict[torch.nn.Parameter, Dict[str, Optional[torch.Tensor]]]) -> None:
    """Give every parameter its fp32 weight (`values[param]["fp32"]`, this rank's TP slice, whole), and the
    fp32 master's fragment where ZeRO 1/2 or the bf16 optimizer keep one; the optimizer's state is left as
    it is (fresh, for --finetune). Why here: the masters are reached through DeepSpeed's `_hp_mapping`."""
    lp_groups = _low_precision_groups(engine.optimizer)
    with torch.no_grad():
        for param, value in values.items():
            param.data.copy_(value["fp32"].to(param.dtype))
        for lps in lp_groups or ():
            for lp in lps:
                mapping = lp._hp_mapping
                if mapping is not None:  # None: no fragment of this parameter in this DP rank's partition
                    src = mapping.lp_fragment_address
                    mapping.hp_fragment.data.copy_(values[lp]["fp32"].flatten().narrow(0, src.start, src.numel))


def set_optimizer_state(engine, values: Dict[torch.nn.Parameter, Dict[str, Optional[torch.Tensor]]],
                        step: float) -> None:
    """Give every parameter of the engine its fp32 master weight and Adam moments (this rank's TP slice,
    whole: DeepSpeed's own mapping cuts the ZeRO partition), and the optimizer its step count.

    Why: DeepSpeed loads optimizer state only from its own files at the same DP size and ZeRO stage. ZeRO
    1/2 and the bf16 optimizer link each low-precision parameter to its fragment of the flat fp32 partition
    (`param._hp_mapping`: hp_fragment, lp/hp fragment addresses); the plain torch optimizer (fp32, ZeRO 0)
    holds the parameters themselves."""
    optimizer = engine.optimizer
    lp_groups = _low_precision_groups(optimizer)

    def step_on(device):  # torch's fused AdamW keeps its step on the parameter's device
        return torch.tensor(float(step), dtype=torch.float32, device=device)
    set_master_weights(engine, values)
    with torch.no_grad():
        if lp_groups is None:  # a torch optimizer over the parameters themselves
            inner = optimizer
            for param, value in values.items():
                if value["exp_avg"] is not None:  # Muon's matrices have no exp_avg_sq (training/muon.py)
                    inner.state[param] = {"step": step_on(param.device), **{
                        key: value[key].to(param.device, torch.float32, copy=True)
                        for key in ("exp_avg", "exp_avg_sq") if value.get(key) is not None}}
            return
        inner = optimizer.optimizer
        for index, partition in optimizer_partitions(optimizer).items():
            group = inner.param_groups[index]
            flat = group["params"][0]
            # Muon's group keeps one buffer, named as AdamW's first moment (training/muon.py).
            kept = ("exp_avg",) if group.get("muon") else ("exp_avg", "exp_avg_sq")
            moments = {key: torch.zeros_like(flat) for key in kept}
            for lp in partition.params:
                fragment = partition.fragments.get(id(lp))
                if fragment is None:  # no fragment of this parameter in this DP rank's partition
                    continue
                start, count, at = fragment
                for key, buffer in moments.items():
                    if values[lp][key] is not None:
                        buffer.narrow(0, at, count).copy_(values[lp][key].flatten().narrow(0, start, count))
            inner.state[flat] = {"step": step_on(flat.device), **moments}
            for lp in partition.params:
                if id(lp) in partition.fragments:
                    lp._hp_mapping.set_optim_state_fragment(flat, inner.state[flat])


def loss_scaler_state(optimizer) -> Optional[Dict[str, object]]:
    """The fp16 loss scaler's state (current scale, iterations since an overflow, hysteresis), or None."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return None if scaler is None else dict(vars(scaler))


def set_loss_scaler_state(optimizer, saved: Optional[Dict[str, object]]) -> None:
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None or not saved:
        return
    for key, value in saved.items():
        if key in vars(scaler) and key != "dtype":
            setattr(scaler, key, value)


def set_step_counters(engine, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """The engine's step counters, as its own load_checkpoint sets them."""
    engine.global_steps = global_steps
    engine.global_samples = global_samples
    engine.skipped_steps = skipped_steps
