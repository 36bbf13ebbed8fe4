"""A checkpoint rewritten for another TP x PP layout, so `pretrain_gpt.py --load` continues under it.

Carried over: every weight (cut for the new TP), the AdamW moments of ZeRO 0
checkpoints cut exactly like their parameters (`--no-optimizer` leaves them
out: the run then starts with fresh moments), iteration, consumed samples,
the LR schedule and DeepSpeed's step counters. Random generator states are
copied only when TP and PP stay the same: they belong to a rank's place in
the layout (a stage draws dropout masks for its own layers), so under a new
layout the run reseeds from --seed as a fresh run does. When the new TP pads
the vocabulary differently, padded rows are dropped or zero rows added.

The target is written into a temporary sibling folder and renamed into place
at the end; an existing --save folder is never written into.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

import torch

from megatron_lite.checkpoint import slicing
from megatron_lite.atomic import WriteError, atomic_folder, describe, torch_save
from megatron_lite.checkpoint.format import (
    CheckpointError,
    layer_file,
    load_file,
    rng_files,
    write_latest,
    write_metadata,
)
from megatron_lite.checkpoint.format import model_states_file as mp_rank_file
from megatron_lite.checkpoint.layout import ModelLayout
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.checkpoint.vocab import is_vocab_parameter, resize_rows
from megatron_lite.config import Config, ConfigError, pad_vocab_size


def target_config(source: Config, tp: int, pp: int, partition_method: Optional[str]) -> Config:
    m, p = source.model, source.parallel
    if tp < 1:
        raise CheckpointError(f"--target-tensor-model-parallel-size {tp} must be at least 1 and divide the model's "
                              f"{m.num_attention_heads} attention heads")
    if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
        raise CheckpointError(f"--target-tensor-model-parallel-size {tp} does not divide the model's "
                              f"{m.num_attention_heads} attention heads and --ffn-hidden-size {m.ffn_hidden_size}; "
                              f"use a TP size that divides both")
    if pp < 1 or m.num_layers < pp:
        raise CheckpointError(f"--target-pipeline-model-parallel-size {pp} must be between 1 and the model's "
                              f"{m.num_layers} transformer layers")
    method = partition_method or p.pipeline_partition_method
    if partition_method is None and method[0].isdigit():  # explicit counts were for the old PP
        method = "cost"
    padded = m.padded_vocab_size
    if m.vocab_size is not None:
        padded = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    dp = p.data_parallel_size
    config = source.replace(parallel__tensor_model_parallel_size=tp, parallel__pipeline_model_parallel_size=pp,
                            parallel__pipeline_partition_method=method, parallel__world_size=tp * pp * dp,
                            model__padded_vocab_size=padded)
    try:
        ModelLayout(config).stage_bounds(pp, method)
    except ConfigError as e:
        raise CheckpointError(f"--target-pipeline-partition-method: {e}") from None
    return config


def _default_groups(config: Config) -> List[dict]:
    """AdamW group settings as training/optimizer.py builds them, for a source without a plain AdamW state."""
    o = config.optimizer
    common = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, amsgrad=False, maximize=False,
                  foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True,
                  initial_lr=o.lr)
    return [dict(common, weight_decay=o.weight_decay), dict(common, weight_decay=0.0)]


def _slice_state(entry: Dict, info, tp: int, rows: Optional[int]) -> List[Dict]:
    per_rank = [{} for _ in range(tp)]
    for name, value in entry.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if rows is not None:
                value = resize_rows(value, rows)
            for r, piece in enumerate(slicing.split(value, tp, info.partition_dim, info.partition_stride)):
                per_rank[r][name] = piece
        else:
            for r in range(tp):
                per_rank[r][name] = value.clone() if torch.is_tensor(value) else value
    return per_rank


def reshard(load_dir: str, save_dir: str, tp: int, pp: int, iteration: Optional[int] = None,
            no_optimizer: bool = False, partition_method: Optional[str] = None, log=print) -> dict:
    if os.path.exists(save_dir):
        raise CheckpointError(f"--save {save_dir} already exists; give a new folder (the source and any existing "
                              f"checkpoint are never written over)")
    reader = CheckpointReader(load_dir, iteration)
    config = target_config(reader.config, tp, pp, partition_method)
    layout = ModelLayout(config)
    bounds = layout.stage_bounds(pp, config.parallel.pipeline_partition_method)
    rows = config.model.padded_vocab_size
    weights = reader.full_weights()
    states, groups = (({}, []) if no_optimizer else reader.optimizer_states())
    base = reader.rank_state(0, 0)
    if not groups:
        groups = _default_groups(config)

    parent = os.path.dirname(os.path.abspath(save_dir))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(save_dir, describe(e)) from None
    with atomic_folder(save_dir) as tmp_root:
        tmp = os.path.join(tmp_root, reader.tag)
        os.makedirs(tmp)
        for spec in layout.layer_specs_with_files():
            per_rank = [{} for _ in range(tp)]
            for info in layout.params[spec]:
                full = weights[(spec, info.name)]
                if is_vocab_parameter(info.name):
                    full = resize_rows(full, rows)
                full = full.to(reader.dtypes[(spec, info.name)])
                for r, piece in enumerate(slicing.split(full, tp, info.partition_dim, info.partition_stride)):
                    per_rank[r][info.name] = piece.contiguous()
            for r in range(tp):
                torch_save(per_rank[r], os.path.join(tmp, layer_file(spec, r)))
            log(f"  layer {spec:02d}: {len(per_rank[0])} tensors x {tp} TP ranks")

        for stage in range(pp):
            params = layout.stage_parameters(bounds[stage], bounds[stage + 1])
            opt_state = [{} for _ in range(tp)]
            for index, (info, copy) in enumerate(params):
                entry = states.get((info.spec, info.name, copy)) or states.get((info.spec, info.name, not copy))
                if entry is None:
                    continue
                pieces = _slice_state(entry, info, tp, rows if is_vocab_parameter(info.name) else None)
                for r in range(tp):
                    opt_state[r][index] = pieces[r]
            decay = sum(1 for info, _ in params if info.decays)
            param_groups = []
            if decay:
                param_groups.append(dict(groups[0], params=list(range(decay))))
            if len(params) > decay:
                param_groups.append(dict(groups[-1], params=list(range(decay, len(params)))))
            for r in range(tp):
                state = dict(base)
                state.update(module=None, optimizer={"state": opt_state[r], "param_groups": param_groups},
                             mp_world_size=tp * pp,
                             checkpoint_parallel_dimensions={"pp_degree": pp, "tp_degree": tp})
                torch_save(state, os.path.join(tmp, mp_rank_file(stage, r, tp)))

        copied_rng = reader.tp == tp and reader.pp == pp
        if copied_rng:  # read and written again, never copied unread: a file is validated before it travels
            for name in rng_files(reader.path):
                torch_save(load_file(os.path.join(reader.path, name)), os.path.join(tmp, name))
        metadata = dict(reader.metadata)
        metadata.update(layout={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                "data_parallel_size": config.parallel.data_parallel_size},
                        config=dataclasses.asdict(config), optimizer_states=not no_optimizer,
                        resharded_from={"path": os.path.abspath(reader.path), "tensor_model_parallel_size": reader.tp,
                                        "pipeline_model_parallel_size": reader.pp})
        write_metadata(tmp, metadata)
        write_latest(tmp_root, reader.tag)
    return {"tag": reader.tag, "source": (reader.tp, reader.pp), "target": (tp, pp),
            "optimizer": not no_optimizer, "rng": copied_rng, "padded_vocab": (reader.config.model.padded_vocab_size, rows),
            "partition_method": config.parallel.pipeline_partition_method}
