"""Where each pipeline stage's time goes: `--timing-breakdown`.

Every instruction the pipeline engine runs is timed on every rank (see
deepspeed_compat.pipeline.time_pipeline_instructions) and summed per category over the
log interval ("loss" is the broadcast of the loss from the last stage that ends
every step: the other stages wait for it there). At each log line the first rank of every stage sends its sums to
rank 0, which prints one small table and writes `timing/stage{N}/{category}`
to TensorBoard. Time a fast stage spends blocked in recv is the imbalance,
measured; "other" is the step time no instruction accounts for. Under context parallelism
a last column, "cp-a2a", is the time spent in the attention's all-to-alls (parallel/context_parallel.py
counts it), a part of forward and backward rather than beside them; under expert parallelism likewise
"ep-a2a", the MoE layers' dispatch and combine all-to-alls (parallel/experts.py).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_lite.deepspeed_compat import pipeline
from megatron_lite.parallel import context_parallel, experts, state

CATEGORY = {
    "LoadMicroBatch": "load", "ForwardPass": "forward", "BackwardPass": "backward",
    "SendActivation": "send", "SendGrad": "send", "RecvActivation": "recv", "RecvGrad": "recv",
    "ReduceGrads": "reduce", "ReduceTiedGrads": "reduce", "OptimizerStep": "optimizer", "AggregateLoss": "loss",
    # --pipeline-schedule dualpipev: its sends and receives only queue; CommitP2P launches them and waits for the
    # peers, so the time blocked on them (what recv is under 1F1B) is spent there.
    "CommitP2P": "recv",
}
COLUMNS = ("forward", "backward", "recv", "send", "reduce", "optimizer", "loss", "load", "other")


class StageTimer:
    def __init__(self, pipeline_engine):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.a2a_from = context_parallel.seconds()
        self.ep_a2a_from = experts.seconds()
        synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        pipeline.time_pipeline_instructions(pipeline_engine, self._record, synchronize)

    def _record(self, instruction: str, seconds: float) -> None:
        self.seconds[CATEGORY.get(instruction, instruction)] += seconds

    @contextlib.contextmanager
    def paused(self):
        """Instructions run inside (evaluation) do not count toward the training interval."""
        saved, a2a, ep_a2a = dict(self.seconds), context_parallel.seconds(), experts.seconds()
        try:
            yield
        finally:
            self.seconds = defaultdict(float, saved)
            self.a2a_from += context_parallel.seconds() - a2a
            self.ep_a2a_from += experts.seconds() - ep_a2a

    def take(self, step_seconds: float) -> Dict[str, float]:
        """This interval's sums (with "other" = step time - instructions) and a fresh start."""
        sums = dict(self.seconds)
        sums["other"] = max(step_seconds - sum(sums.values()), 0.0)
        sums["step"] = step_seconds
        if context_parallel.cp_world_size() > 1:
            sums["cp-a2a"] = context_parallel.seconds() - self.a2a_from  # inside forward and backward
        self.a2a_from = context_parallel.seconds()
        if experts.ep_world_size() > 1:
            sums["ep-a2a"] = experts.seconds() - self.ep_a2a_from  # inside forward and backward
        self.ep_a2a_from = experts.seconds()
        self.seconds = defaultdict(float)
        return sums


def gather_stages(value) -> List[Tuple[int, object]]:
    """(stage, value) of each stage's first rank, on rank 0 ([] elsewhere). A collective: every rank calls it."""
    first_of_stage = (state.get_data_parallel_rank(with_context_parallel=True) == 0
                      and state.get_tensor_model_parallel_rank() == 0)
    mine = (state.get_pipeline_model_parallel_rank(), value) if first_of_stage else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(entry for entry in everyone if entry is not None) if dist.get_rank() == 0 else []


def format_table(stages: List[Tuple[int, Dict[str, float]]], iterations: int) -> str:
    """Milliseconds per iteration, one line per stage; the last column is the measured step time."""
    columns = COLUMNS + tuple(c for c in ("cp-a2a", "ep-a2a") if any(c in sums for _, sums in stages))
    header = (f"{'stage':>5} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'step':>9}"
              + "".join(f" {c:>9}" for c in columns[len(COLUMNS):]) + "   (ms per iteration)")
    lines = [header]
    for stage, sums in stages:
        cells = " ".join(f"{1e3 * sums.get(c, 0.0) / iterations:>9.1f}" for c in COLUMNS)
        extra = "".join(f" {1e3 * sums.get(c, 0.0) / iterations:>9.1f}" for c in columns[len(COLUMNS):])
        lines.append(f"{stage:>5} {cells} {1e3 * sums['step'] / iterations:>9.1f}{extra}")
    return "\n".join(lines)


def scalars(stages: List[Tuple[int, Dict[str, float]]], iterations: int) -> Dict[str, float]:
    """TensorBoard scalars: timing/stage{N}/{category} in ms per iteration."""
    return {f"stage{stage}/{name}": 1e3 * value / iterations for stage, sums in stages for name, value in sums.items()}
