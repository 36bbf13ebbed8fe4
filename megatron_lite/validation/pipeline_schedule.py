"""--pipeline-schedule dualpipev: what DeepSpeed's DualPipeVEngine asserts, refused before any process group exists.

DualPipeVEngine.__init__ (deepspeed/runtime/pipe/dualpipev.py) asserts gradient accumulation steps >= 2 x PP,
pipe_partitioned and grad_partitioned off (deepspeed_config.py turns them off under dualpipev), no dynamic
shapes (we never ask for them) and no bool tensors between stages (ours send hidden states and int32 document
ids). The stage split cuts 2 x PP stages, each with a transformer layer (model/partition.py).
"""
from __future__ import annotations

from typing import List

from megatron_lite.config import Config, ConfigError
from megatron_lite.model.virtual_stages import SCHEDULES


def pipeline_schedule_rules(config: Config, notes: List[str]) -> Config:
    p, b = config.parallel, config.batch
    schedule, pp = p.pipeline_schedule, p.pipeline_model_parallel_size
    if schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule} is not one of {', '.join(SCHEDULES)}; use 1f1b",
                          code="pipeline_schedule")
    if schedule != "dualpipev":
        return config
    if pp < 2:
        raise ConfigError(f"--pipeline-schedule dualpipev runs two stages on each of at least 2 pipeline ranks, got "
                          f"--pipeline-model-parallel-size {pp}; use --pipeline-model-parallel-size 2 or more, or "
                          f"--pipeline-schedule 1f1b", code="dualpipev_needs_pipeline")
    layers = config.model.num_layers
    if layers < 2 * pp:
        raise ConfigError(f"--pipeline-schedule dualpipev cuts the layers into 2 x --pipeline-model-parallel-size "
                          f"{pp} = {2 * pp} stages, each with a transformer layer, but --num-layers is {layers}; use "
                          f"--pipeline-model-parallel-size {max(layers // 2, 1)} or less, or --pipeline-schedule "
                          f"1f1b", code="dualpipev_layers")
    unit = b.micro_batch_size * p.data_parallel_size
    smallest = b.global_batch_size if b.rampup_batch_size is None else min(b.rampup_batch_size[0],
                                                                           b.global_batch_size)
    gas = smallest // unit
    if gas < 2 * pp:
        where = (f"--rampup-batch-size starts at {smallest} samples: " if b.rampup_batch_size is not None
                 and smallest < b.global_batch_size else "")
        raise ConfigError(f"--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size {pp} = "
                          f"{2 * pp} micro-batches per step (DeepSpeed's DualPipeVEngine), got {where}gradient "
                          f"accumulation steps {gas} (global batch {smallest} / (micro batch {b.micro_batch_size} x "
                          f"data-parallel size {p.data_parallel_size})); use "
                          + ("a --rampup-batch-size start" if where else "--global-batch-size")
                          + f" of {2 * pp * unit} or more, or --pipeline-schedule 1f1b", code="dualpipev_micro_batches")
    return config
