"""--load of a checkpoint saved under another layout, ZeRO stage or precision: through its layout-free form.

Each rank reads, for its own layers only, its TP slice of every parameter's fp32 master weight and Adam
moments, and the step (checkpoint/layout_free.py: only the bytes of that slice, from memory-mapped files),
with padded vocabulary rows dropped or added, and hands them to the engine, whose own fragment mapping cuts the ZeRO partition (deepspeed_compat.optimizer_state.set_optimizer_state). The LR
schedule, DeepSpeed's step counters and the fp16 loss scale follow. Random generators are kept when every
rank keeps its stage and TP rank (any DP rank's streams are every DP rank's), else reseeded from --seed.
Ranks agree on any problem before any of them touches the engine, so a bad file stops all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lite.checkpoint.format import CheckpointError, data_ranks, layout_of
from megatron_lite.checkpoint.layout import ModelLayout, saved_schedule
from megatron_lite.checkpoint.layout_free import LayoutFreeReader, storage_of
from megatron_lite.config import Config
from megatron_lite.deepspeed_compat import checkpoint_files, optimizer_state
from megatron_lite.parallel import state
from megatron_lite.parallel.experts import ep_rank, is_expert_parameter
from megatron_lite.training.distributed import gather_problems
from megatron_lite.training.rng_state import read_rng_state, set_rng_state


@dataclass
class Resumed:
    iteration: int
    consumed_samples: int
    note: Optional[str] = None
    """What a resume under another layout did (printed by rank 0), None for a plain resume."""


def agree(action):
    """Run `action` on every rank; a CheckpointError on any rank is raised on all of them (first rank's)."""
    result, problem = None, None
    try:
        result = action()
    except CheckpointError as e:
        problem = str(e)
    problems = gather_problems(problem)
    if problems:
        raise CheckpointError(problems[0])
    return result


def _describe_layout(layout: dict, storage, schedule: str = "1f1b") -> str:
    zero, precision = storage
    cp, ep = layout.get("context_parallel_size") or 1, layout.get("expert_model_parallel_size") or 1
    return (f"TP {layout['tensor_model_parallel_size']}{f' x CP {cp}' if cp > 1 else ''} x PP "
            f"{layout['pipeline_model_parallel_size']}{f' ({schedule})' if schedule != '1f1b' else ''} x DP "
            f"{layout.get('data_parallel_size')}"
            f"{f' (EP {ep})' if ep > 1 else ''} (ZeRO {zero}, {precision})")


def _local_states(engine, config: Config, folder: str, metadata: dict, optimizer: bool):
    """{this rank's parameter: its slice of the fp32 master and moments}, {this rank's saved buffer (an MoE
    router's expert bias): its value}, the step, and the run state."""
    p = config.parallel
    tp, tp_rank = p.tensor_model_parallel_size, state.get_tensor_model_parallel_rank()
    layout = ModelLayout(config)
    params = {}
    for (owner, name), param in checkpoint_files.engine_parameters(engine.module).items():
        params[(layout.tied_spec[owner] if isinstance(owner, str) else owner, name)] = param
    reader = LayoutFreeReader(folder, metadata)
    # Only this rank's slices are read (checkpoint/sliced.py), the vocabulary padded as this run pads it.
    saved = reader.read({spec for spec, _ in params}, optimizer=optimizer, tp=tp, rank=tp_rank,
                        rows=config.model.padded_vocab_size)
    values, steps = {}, []
    for key, param in params.items():
        entry = saved[key]
        values[param] = {"fp32": entry.fp32, "exp_avg": entry.exp_avg, "exp_avg_sq": entry.exp_avg_sq}
        if is_expert_parameter(param):  # saved: every expert; this rank holds its EP block
            count = param.shape[0]
            values[param] = {k: None if v is None else v.narrow(0, ep_rank() * count, count)
                             for k, v in values[param].items()}
        if entry.step is not None:
            steps.append(entry.step)
    # Buffers are not the optimizer's: without them a layer would resume with its fresh values.
    saved_buffers = reader.read_buffers({spec for spec, _ in params})
    buffers = {}
    for name, buffer in engine.module.named_buffers():
        owner, inner = checkpoint_files.pipeline_parameter_owner(name)
        key = (layout.tied_spec[owner] if isinstance(owner, str) else owner, inner)
        if key in saved_buffers:
            buffers[buffer] = saved_buffers[key]
    return values, buffers, max(steps, default=0.0), reader.run_state() if optimizer else None


@torch.no_grad()
def _set_buffers(buffers) -> None:
    for buffer, value in buffers.items():
        buffer.copy_(value.to(buffer.dtype))


def load_layout_free(engine, config: Config, folder: str, metadata: dict, same_places: bool) -> Resumed:
    values, buffers, step, run = agree(lambda: _local_states(engine, config, folder, metadata, optimizer=True))
    optimizer_state.set_optimizer_state(engine.engine, values, step)
    _set_buffers(buffers)
    if run.lr_scheduler is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(run.lr_scheduler)
        # The schedule's state does not set the optimizer's learning rate (DeepSpeed's own load restores it
        # with the optimizer's param_groups): the next step uses the rate the schedule last gave.
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    optimizer_state.set_step_counters(engine.engine, run.global_steps, run.global_samples, run.skipped_steps)
    if config.precision.fp16:
        optimizer_state.set_loss_scaler_state(engine.optimizer, run.loss_scaler)
    p, saved = config.parallel, metadata["layout"]
    rng = agree(lambda: _rng_of_same_place(folder, saved)) if same_places else None
    if rng is not None:
        set_rng_state(rng)
        randomness = "random generators kept (each stream is the same on every DP rank)"
    else:
        randomness = "random generators reseeded from --seed (the ranks' places in the layout changed)"
    ours = layout_of(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                     p.context_parallel_size, p.expert_model_parallel_size)
    note = (f"resharded {_describe_layout(saved, storage_of(metadata), saved_schedule(metadata))} -> "
            f"{_describe_layout(ours, (p.zero_stage, config.precision.dtype_name), p.pipeline_schedule)}: fp32 weights, "
            f"{'Muon momentum and Adam' if config.optimizer.optimizer == 'muon' else 'Adam'} moments "
            f"and step, LR schedule, step counters{', loss scale' if config.precision.fp16 else ''}; {randomness}")
    return Resumed(run.iteration, run.consumed_samples, note)


def _rng_of_same_place(folder: str, saved_layout: dict) -> Optional[dict]:
    """The saved random generators of the rank that had this rank's stage, CP rank and TP rank at DP rank 0:
    every stream is seeded without the DP rank, so any DP rank's state is every DP rank's. (Called only when
    TP, PP and CP are the saved ones: the data axis is DP x CP, CP fastest.)"""
    tp = saved_layout["tensor_model_parallel_size"]
    return read_rng_state(folder, state.get_pipeline_model_parallel_rank() * data_ranks(saved_layout) * tp
                          + state.get_context_parallel_rank() * tp + state.get_tensor_model_parallel_rank())


def load_weights_layout_free(engine, config: Config, folder: str, metadata: dict) -> None:
    """The model's weights only (evaluation under another layout)."""
    values, buffers, _, _ = agree(lambda: _local_states(engine, config, folder, metadata, optimizer=False))
    with torch.no_grad():
        for param, value in values.items():
            param.data.copy_(value["fp32"].to(param.dtype))
    _set_buffers(buffers)


def load_weights_fresh_optimizer(engine, config: Config, folder: str, metadata: dict) -> None:
    """Weights only, from any layout, into parameters and fp32 masters (--finetune, imported models); the
    optimizer, schedule, counters and random generators stay as a new run has them."""
    values, buffers, _, _ = agree(lambda: _local_states(engine, config, folder, metadata, optimizer=False))
    optimizer_state.set_master_weights(engine.engine, values)
    _set_buffers(buffers)
