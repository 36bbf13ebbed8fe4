"""How fast a pipeline can run compared with data parallelism, from its stage costs.

DeepSpeed's TrainSchedule (1F1B) makes each stage meet its neighbours once per
micro-batch and otherwise run a forward and a backward back to back, so with
gas micro-batches and PP stages the steady state takes gas x the slowest
stage's time, plus (PP - 1) of those periods to fill and drain:

    efficiency = gas / (gas + PP - 1)  x  mean(stage time) / max(stage time)

The first factor is the bubble, the second the imbalance. Transfers and the
optimizer step are not in it; the per-stage timing breakdown measures them.
"""
from __future__ import annotations

from typing import Sequence


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


def predicted_pipeline_efficiency(stage_costs: Sequence[float], num_micro_batches: int) -> float:
    """Throughput of the pipeline relative to data parallelism over as many ranks, from the
    stages' costs (any unit: seconds measured or FLOPs) and the gradient-accumulation steps."""
    return bubble_efficiency(len(stage_costs), num_micro_batches) * balance(stage_costs)
