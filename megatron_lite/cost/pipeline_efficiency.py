"""How fast a pipeline can run compared with data parallelism, from its stage costs.

DeepSpeed's TrainSchedule (1F1B) makes each stage meet its neighbours once per
micro-batch and otherwise run a forward and a backward back to back, so with
gas micro-batches and PP stages the steady state takes gas x the slowest
stage's time, plus (PP - 1) of those periods to fill and drain:

    efficiency = gas / (gas + PP - 1)  x  mean(stage time) / max(stage time)

The first factor is the bubble, the second the imbalance. Transfers and the
optimizer step are not in it; the per-stage timing breakdown measures them.

DeepSpeed's DualPipeVSchedule (--pipeline-schedule dualpipev) cuts the layers into 2 PP stages and gives rank r
stages r and 2 PP - 1 - r. With F and B one such stage's forward and backward (half a 1F1B stage's), a rank
works 2 gas (F + B) per step and idles

    bubble = max(3F, 2B) + (PP - 2) (F + B + max(F, B))          (PP >= 2, gas >= 2 PP)

whatever gas is. That is a replay of DeepSpeed's own instruction streams (cost/schedule_replay.py; the test
replays the schedule DeepSpeed generates at PP 2..8): every CommitP2P waits until its peers have posted the
matching sends and receives. DeepSpeed keeps the weight gradients inside BackwardPass (no zero-bubble W) and
runs a forward and a backward one after the other, so the gain over 1F1B's (PP - 1)(2F + 2B) is the V
placement only: at B = 2F, 5 PP - 6 forwards of idle time against 6 PP - 6. A rank's two stages together set
the pace, so the imbalance is that of the ranks' summed stage costs.
"""
from __future__ import annotations

from typing import List, Sequence

BACKWARD_RATIO = 2.0
"""A backward's cost over its forward's (the FLOPs of two matmuls per forward one), where nothing measured it."""


def bubble_efficiency(num_stages: int, num_micro_batches: int) -> float:
    """gas / (gas + PP - 1): what balanced stages reach."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"stages {num_stages} and micro-batches {num_micro_batches} must be at least 1")
    return num_micro_batches / (num_micro_batches + num_stages - 1)


def balance(stage_costs: Sequence[float]) -> float:
    """mean / max of the stages' costs: 1.0 when balanced."""
    if not stage_costs or min(stage_costs) < 0 or max(stage_costs) <= 0:
        raise ValueError(f"stage costs {list(stage_costs)} must be non-negative with a positive maximum")
    return sum(stage_costs) / len(stage_costs) / max(stage_costs)


def dualpipev_bubble(num_ranks: int, forward: float, backward: float) -> float:
    """A rank's idle time per step under DualPipeV (module docstring): forward and backward are one stage's
    (a rank holds two stages)."""
    if num_ranks < 2:
        raise ValueError(f"DualPipeV needs at least 2 pipeline ranks, got {num_ranks}")
    return max(3 * forward, 2 * backward) + (num_ranks - 2) * (forward + backward + max(forward, backward))


def dualpipev_bubble_efficiency(num_ranks: int, num_micro_batches: int,
                                backward_ratio: float = BACKWARD_RATIO) -> float:
    """What balanced stages reach under DualPipeV: work / (work + bubble), work = 2 gas (F + B)."""
    if num_micro_batches < 2 * num_ranks:
        raise ValueError(f"DualPipeV needs at least 2 x {num_ranks} micro-batches, got {num_micro_batches}")
    work = 2 * num_micro_batches * (1.0 + backward_ratio)
    return work / (work + dualpipev_bubble(num_ranks, 1.0, backward_ratio))


def bubble_periods(schedule: str, num_ranks: int, backward_ratio: float = BACKWARD_RATIO) -> float:
    """The fill and drain of a step, in periods of the slowest rank's forward + backward of one micro-batch:
    PP - 1 under 1F1B, DualPipeV's bubble over 2 (F + B) (a period is two stages' work there)."""
    if schedule == "dualpipev":
        return dualpipev_bubble(num_ranks, 1.0, backward_ratio) / (2 * (1.0 + backward_ratio))
    return num_ranks - 1.0


def rank_costs(stage_costs: Sequence[float], schedule: str) -> List[float]:
    """Each pipeline rank's cost: its stage's, or under DualPipeV the sum of its two stages' (r and 2P-1-r)."""
    if schedule != "dualpipev":
        return list(stage_costs)
    if len(stage_costs) % 2:
        raise ValueError(f"DualPipeV cuts an even number of stages, got {len(stage_costs)}")
    half = len(stage_costs) // 2
    return [stage_costs[r] + stage_costs[len(stage_costs) - 1 - r] for r in range(half)]


def predicted_pipeline_efficiency(stage_costs: Sequence[float], num_micro_batches: int,
                                  schedule: str = "1f1b") -> float:
    """Throughput of the pipeline relative to data parallelism over as many ranks, from the
    stages' costs (any unit: seconds measured or FLOPs) and the gradient-accumulation steps; under
    dualpipev the costs are the 2 PP stages'."""
    if schedule == "dualpipev":
        ranks = rank_costs(stage_costs, schedule)
        return dualpipev_bubble_efficiency(len(ranks), num_micro_batches) * balance(ranks)
    return bubble_efficiency(len(stage_costs), num_micro_batches) * balance(stage_costs)
