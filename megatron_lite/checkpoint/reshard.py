"""A checkpoint rewritten for another TP x PP layout, or into its layout-free form.

`reshard` reads any checkpoint the trainer saves (ZeRO 0 or 1; fp32, bf16 or fp16; any TP/PP/DP) through
its layout-free form (layout_free.py) and writes the target layout in the simplest form DeepSpeed reads:
fp32 layer files and, per stage and TP rank, a plain AdamW state with every parameter's moments and step
(what an fp32 ZeRO 0 run saves), with iteration, consumed samples, the LR schedule and DeepSpeed's step
counters. The metadata records that storage, so `pretrain_gpt.py --load` under any ZeRO stage and precision
takes it (bf16 and ZeRO 1 runs through the layout-free path, with the fp32 masters). `--no-optimizer` leaves
the moments out (the run then starts them fresh). Random generator states are carried over only when TP and
PP stay the same: they belong to a rank's place in the layout; otherwise the run reseeds from --seed. When
the new TP pads the vocabulary differently, padded rows are dropped or zero rows added, weights and moments
alike. `universal` writes the layout-free form itself, which --load reads under any layout.

Targets are written into a temporary sibling folder and renamed into place at the end; an existing folder
is never written into.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import List, Optional, Tuple

import torch

from megatron_lite.atomic import atomic_folder, torch_save
from megatron_lite.checkpoint import preflight
from megatron_lite.checkpoint.format import (
    CheckpointError,
    layer_file,
    layout_of,
    load_file,
    read_metadata,
    resolve_tag,
    rng_files,
    write_latest,
    write_metadata,
)
from megatron_lite.checkpoint.format import model_states_file as mp_rank_file
from megatron_lite.checkpoint.layout import ModelLayout, ParamInfo, slice_shape
from megatron_lite.checkpoint.layout_free import LayoutFreeReader, write_universal
from megatron_lite.checkpoint.optimizer_groups import parameter_groups, saved_group_settings
from megatron_lite.checkpoint.preflight import refuse_existing
from megatron_lite.config import Config, ConfigError, pad_vocab_size
from megatron_lite.deepspeed_compat.experts import expert_optimizer_groups, mark_expert_parameters
from megatron_lite.model.moe_options import expert_ffn_hidden_size
from megatron_lite.model.partition import check_partition_method


def target_config(source: Config, tp: int, pp: int, partition_method: Optional[str]) -> Config:
    m, p = source.model, source.parallel
    preflight.refuse_target_sizes(m.num_attention_heads, m.num_layers, tp, pp)
    if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
        raise CheckpointError(f"--target-tensor-model-parallel-size {tp} does not divide the model's "
                              f"{m.num_attention_heads} attention heads and --ffn-hidden-size {m.ffn_hidden_size}; "
                              f"use a TP size that divides both")
    if m.num_experts is not None:  # each expert, and the shared expert, is split column-wise like the dense MLP
        for flag, width in (("--moe-ffn-hidden-size", expert_ffn_hidden_size(m)),
                            ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size)):
            if width is not None and width % tp:
                fits = [t for t in range(1, tp) if not width % t and not m.num_attention_heads % t]
                raise CheckpointError(f"--target-tensor-model-parallel-size {tp} does not divide the model's "
                                      f"{flag} {width}: each expert is split over TP like the dense MLP; use a TP "
                                      f"size that divides it, e.g. {' or '.join(map(str, fits[-2:]))}")
    groups = m.num_query_groups or m.num_attention_heads
    head_dim = m.head_dim
    if (groups % tp and tp % groups) or (groups < tp and (groups * head_dim) % tp):
        raise CheckpointError(f"--target-tensor-model-parallel-size {tp} does not fit the model's {groups} query "
                              f"groups: a TP size must divide the groups, or be a multiple of them that divides "
                              f"their {groups * head_dim} key/value rows; e.g. "
                              f"{' or '.join(str(t) for t in (1, 2, 4, 8) if not groups % t or not t % groups)}")
    method = partition_method or p.pipeline_partition_method
    if partition_method is None and method[0].isdigit():  # explicit counts were for the old PP
        method = "cost"
    try:
        check_partition_method(method, m.num_layers, pp, "--target-pipeline-partition-method")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    padded = m.padded_vocab_size
    if m.vocab_size is not None:
        padded = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    dp, cp = p.data_parallel_size, p.context_parallel_size  # kept: the run's batch and sequence split
    # The target is a 1F1B layout (one stage per pipeline rank), whatever --pipeline-schedule the source ran.
    config = source.replace(parallel__tensor_model_parallel_size=tp, parallel__pipeline_model_parallel_size=pp,
                            parallel__pipeline_partition_method=method, parallel__world_size=tp * pp * dp * cp,
                            parallel__pipeline_schedule="1f1b", model__padded_vocab_size=padded)
    try:
        ModelLayout(config).stage_bounds(pp, method)
    except ConfigError as e:  # a type:<regex> that matches no layer
        raise CheckpointError(str(e).replace("--pipeline-partition-method", "--target-pipeline-partition-method",
                                             1)) from None
    return config


def _group_settings(config: Config, lr_scheduler: Optional[dict]) -> dict:
    """AdamW group settings as a run saves them (checkpoint/optimizer_groups.py), at the learning rate the schedule last
    gave (DeepSpeed restores the optimizer's rate from these groups; one schedule sets every group's alike)."""
    o = config.optimizer
    last = (lr_scheduler or {}).get("_last_lr") or [o.lr]
    return dict(saved_group_settings(o), initial_lr=o.lr, lr=last[0])  # initial_lr: the LambdaLR schedule adds it


def _engine_state(run, optimizer: dict, tp: int, pp: int, dp: int) -> dict:
    """What DeepSpeed's engine saves per stage and TP rank, for a plain torch optimizer."""
    import deepspeed

    return {"module": None, "buffer_names": [], "optimizer": optimizer, "param_shapes": None,
            "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None,
            "lr_scheduler": run.lr_scheduler, "data_sampler": None, "random_ltd": None,
            "skipped_steps": run.skipped_steps, "global_steps": run.global_steps,
            "global_samples": run.global_samples, "dp_world_size": dp, "mp_world_size": tp * pp,
            "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp}, "ds_version": deepspeed.__version__}


def _optimizer_groups(config: Config, params: List[Tuple[ParamInfo, bool]]) -> List[Tuple[dict, List[int]]]:
    """(keys besides the AdamW settings, optimizer indices) of each group training/optimizer.build_optimizer
    makes of a stage's `params` (layout.stage_parameters: the optimizer's order) at this config's TP and EP 1
    (the layer files hold every expert): optimizer_groups.parameter_groups's; with MoE layers each group named
    and the experts moved into groups of their own by DeepSpeed's split, so that torch's load_state_dict finds
    the groups the resumed run's optimizer has."""
    tp = config.parallel.tensor_model_parallel_size
    fakes = []
    for info, _ in params:
        fake = torch.empty(slice_shape(info, tp), device="meta")  # what the split counts: the size on a rank
        fake.expert_parallel = info.experts > 0
        fake.hidden_matrix = info.hidden_matrix
        fakes.append(fake)
    index = {id(fake): i for i, fake in enumerate(fakes)}
    groups = parameter_groups(fakes, config.optimizer.weight_decay, muon=config.optimizer.optimizer == "muon")
    if config.model.num_experts is not None:
        mark_expert_parameters(fakes)
        groups = expert_optimizer_groups([dict(g, name=f"group{i}") for i, g in enumerate(groups)])
    return [({k: v for k, v in g.items() if k != "params"}, [index[id(f)] for f in g["params"]]) for g in groups]


def engine_state(config: Config, layout: ModelLayout, bounds: List[int], run, stage: int, moments: dict) -> dict:
    """One stage's and TP rank's model-states file: a plain AdamW state (`moments`: optimizer index -> step and
    moments; empty for none) with the run's schedule and counters."""
    p = config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = p.data_parallel_size * p.context_parallel_size  # DeepSpeed's data-parallel size
    settings = _group_settings(config, run.lr_scheduler)
    params = layout.stage_parameters(bounds[stage], bounds[stage + 1])
    param_groups = [dict(settings, **keys, params=indices) for keys, indices in _optimizer_groups(config, params)]
    return _engine_state(run, {"state": moments, "param_groups": param_groups}, tp, pp, dp)


def write_engine_states(folder: str, config: Config, layout: ModelLayout, bounds: List[int], run) -> None:
    """Every stage's and TP rank's model-states file, with no optimizer moments (a run starts them fresh)."""
    tp = config.parallel.tensor_model_parallel_size
    for stage in range(config.parallel.pipeline_model_parallel_size):
        for r in range(tp):
            torch_save(engine_state(config, layout, bounds, run, stage, {}),
                       os.path.join(folder, mp_rank_file(stage, r, tp)))


def _source(load_dir: str, iteration: Optional[int]) -> LayoutFreeReader:
    tag = resolve_tag(load_dir, iteration)
    return LayoutFreeReader(os.path.join(load_dir, tag), read_metadata(load_dir, tag))


def reshard(load_dir: str, save_dir: str, tp: int, pp: int, iteration: Optional[int] = None,
            no_optimizer: bool = False, partition_method: Optional[str] = None, log=print,
            overwrite: bool = False) -> dict:
    """`overwrite`: replace an earlier --save folder, once the new one is whole (never the source)."""
    refuse_existing(save_dir, overwrite=overwrite, source=load_dir)
    source = _source(load_dir, iteration)
    tag = os.path.basename(source.folder)
    config = target_config(source.config, tp, pp, partition_method)
    layout = ModelLayout(config)
    bounds = layout.stage_bounds(pp, config.parallel.pipeline_partition_method)
    rows = config.model.padded_vocab_size
    dp = config.parallel.data_parallel_size
    run = source.run_state()
    optimizer = not no_optimizer

    with atomic_folder(save_dir, replace=overwrite) as tmp_root:
        tmp = os.path.join(tmp_root, tag)
        os.makedirs(tmp)
        # One stage and target TP rank at a time, reading only that rank's slices (layout_free.py / sliced.py).
        for stage in range(pp):
            params = layout.stage_parameters(bounds[stage], bounds[stage + 1])
            files = [spec for spec in layout.layer_specs_with_files() if bounds[stage] <= spec < bounds[stage + 1]]
            buffers = source.read_buffers(files)  # whole on every TP rank
            for r in range(tp):
                states = source.read({info.spec for info, _ in params}, optimizer=optimizer, tp=tp, rank=r, rows=rows)
                for spec in files:
                    tensors = {info.name: states[(spec, info.name)].fp32 for info in layout.params[spec]}
                    tensors.update({name: buffers[(spec, name)] for name in layout.buffers[spec]})
                    torch_save(tensors, os.path.join(tmp, layer_file(spec, r)))
                step = max((s.step for s in states.values() if s.step is not None), default=None)
                moments = {}
                for index, (info, _) in enumerate(params):
                    state = states[(info.spec, info.name)]
                    if state.exp_avg is not None:  # Muon's matrices have no exp_avg_sq (training/muon.py)
                        moments[index] = {"step": torch.tensor(float(state.step or step or 0)),
                                          "exp_avg": state.exp_avg}
                        if state.exp_avg_sq is not None:
                            moments[index]["exp_avg_sq"] = state.exp_avg_sq
                torch_save(engine_state(config, layout, bounds, run, stage, moments),
                           os.path.join(tmp, mp_rank_file(stage, r, tp)))
            for spec in files:
                log(f"  layer {spec:02d}: {len(layout.params[spec])} tensors x {tp} TP ranks")

        copied_rng = source.tp == tp and source.pp == pp and not source.universal and source.schedule == "1f1b"
        if copied_rng:  # read and written again, never copied unread: a file is validated before it travels
            for name in rng_files(source.folder):
                torch_save(load_file(os.path.join(source.folder, name)), os.path.join(tmp, name))
        metadata = {k: v for k, v in source.metadata.items()
                    if k not in ("format", "run_state", "converted_from", "pipeline_schedule")}
        metadata.update(iteration=run.iteration, consumed_samples=run.consumed_samples,
                        layout=layout_of(tp, pp, dp, config.parallel.context_parallel_size),
                        layers_per_stage=layout.layers_per_stage(bounds),
                        config=dataclasses.asdict(config), optimizer_states=not no_optimizer,
                        storage={"zero_stage": 0, "precision": "fp32"},
                        resharded_from={"path": os.path.abspath(source.folder), "tensor_model_parallel_size": source.tp,
                                        "pipeline_model_parallel_size": source.pp})
        write_metadata(tmp, metadata)
        write_latest(tmp_root, tag)
    return {"tag": tag, "source": (source.tp, source.pp), "target": (tp, pp),
            "optimizer": not no_optimizer, "rng": copied_rng,
            "padded_vocab": (source.config.model.padded_vocab_size, rows),
            "partition_method": config.parallel.pipeline_partition_method}


def universal(load_dir: str, save_dir: str, iteration: Optional[int] = None, overwrite: bool = False) -> dict:
    """The checkpoint's layout-free form in a new folder (`latest` + the tag folder), loadable anywhere;
    `overwrite` replaces an earlier one."""
    refuse_existing(save_dir, overwrite=overwrite, source=load_dir)
    source = _source(load_dir, iteration)
    tag = os.path.basename(source.folder)
    with atomic_folder(save_dir, replace=overwrite) as tmp_root:
        tmp = os.path.join(tmp_root, tag)
        os.makedirs(tmp)
        write_universal(source, tmp)
        write_latest(tmp_root, tag)
    return {"tag": tag, "source": (source.tp, source.pp, source.dp), "storage": (source.zero_stage, source.precision),
            "parameters": sum(math.prod(i.shape) for infos in source.layout.params.values() for i in infos)}
