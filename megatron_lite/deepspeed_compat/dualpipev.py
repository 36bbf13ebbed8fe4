"""DeepSpeed's DualPipeV (0.19.8, runtime/pipe/dualpipev.py and schedule.py DualPipeVSchedule): our pipeline
module built as its DualPipeVModule, which stages a rank's module holds, and DeepSpeed's schedules as
instruction streams (for cost/schedule_replay.py).

deepspeed.initialize builds a DualPipeVEngine instead of a PipelineEngine for an instance of DualPipeVModule
(deepspeed/__init__.py); building the module is the only switch. Rank r then holds stages r ("phase 0") and
2 PP - 1 - r ("phase 1") of 2 PP; the engine asserts gradient accumulation steps >= 2 PP, no pipe_partitioned /
grad_partitioned sends, no dynamic shapes and no bool tensors between stages (validation/pipeline_schedule.py
refuses all of them first).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from megatron_lite.deepspeed_compat.pipeline import (  # noqa: F401 (re-exported: DualPipeV's own names)
    OwnPartitionPipelineModule,
    is_dualpipev,
    stage_layer_functions,
)


class DualPipeVStages(DualPipeVModule, OwnPartitionPipelineModule):
    """An OwnPartitionPipelineModule built as DeepSpeed's DualPipeVModule: `stage_boundaries` is asked for 2 PP
    stages, and this rank builds stages r and 2 PP - 1 - r.

    Why: DualPipeVModule._partition_layers doubles `num_stages` and calls the next `_partition_layers` of the
    class order, ours, which cuts where `stage_boundaries(2 PP)` says and sets stage r's bounds; DualPipeV then
    reads the mirror stage's bounds from `parts`, builds both stages (`phase_funcs`, `phase_bounds`) and shows
    one at a time as `forward_funcs` (`activate_phase`), which our forward (run_stage) reads. Layer files keep
    their names: DeepSpeed numbers them by `_local_start` of the active phase, the spec's index in the whole
    model."""


def instruction_streams(pp: int, micro_batches: int, schedule: str) -> List[list]:
    """Each pipeline rank's instructions under DeepSpeed's own schedule generator, as cost/schedule_replay.py
    reads them: ("forward", stage), ("backward", stage), ("exchange", [(peer rank, "send"|"recv"), ...]).

    Why from DeepSpeed's generator: the bubble the planner prices must be the one DeepSpeed runs. Under
    DualPipeVSchedule a send or receive only queues (its `phase` says in which direction) and CommitP2P
    launches the queue and waits; under TrainSchedule each send and receive is blocking on its own."""
    from deepspeed.runtime.pipe import schedule as ds

    streams = []
    for rank in range(pp):
        stages = (rank, 2 * pp - 1 - rank) if schedule == "dualpipev" else (rank,)
        if schedule == "dualpipev":
            generator = ds.DualPipeVSchedule(micro_batches=micro_batches, stages=pp, stage_id=rank)
        else:
            generator = ds.TrainSchedule(micro_batches=micro_batches, stages=pp, stage_id=rank)
        stream, queued = [], []
        for step in generator:
            for cmd in step:
                phase = getattr(cmd, "phase", 0)
                towards_last = phase == 0  # phase 0 (and 1F1B) sends activations to rank + 1
                if isinstance(cmd, (ds.SendActivation, ds.RecvGrad)):
                    message = (rank + 1 if towards_last else rank - 1, "send" if isinstance(cmd, ds.SendActivation)
                               else "recv")
                elif isinstance(cmd, (ds.RecvActivation, ds.SendGrad)):
                    message = (rank - 1 if towards_last else rank + 1, "recv" if isinstance(cmd, ds.RecvActivation)
                               else "send")
                elif isinstance(cmd, ds.ForwardPass):
                    stream.append(("forward", stages[phase]))
                    continue
                elif isinstance(cmd, ds.BackwardPass):
                    stream.append(("backward", stages[phase]))
                    continue
                elif isinstance(cmd, ds.CommitP2P):
                    if queued:
                        stream.append(("exchange", queued))
                    queued = []
                    continue
                else:
                    continue
                if schedule == "dualpipev":
                    queued.append(message)
                else:
                    stream.append(("exchange", [message]))
        streams.append(stream)
    return streams


def timed_streams(streams: Sequence[list], seconds: Callable[[str, int], float]) -> List[list]:
    """The streams with each forward and backward replaced by ("compute", seconds(kind, stage))."""
    return [[("compute", seconds(kind, value)) if kind in ("forward", "backward") else (kind, value)
             for kind, value in stream] for stream in streams]
