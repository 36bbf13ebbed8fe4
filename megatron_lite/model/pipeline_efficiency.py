"""Predicted efficiency of DeepSpeed's synchronous 1F1B pipeline relative to no pipeline.

    efficiency = gas / (gas + PP - 1)  x  mean(stage cost) / max(stage cost)

The first factor is the bubble: 2 (gas + PP - 1) schedule steps do the work of
2 gas (DEEPSPEED-NOTES.md: a replay of the real instruction streams gives this
exactly for balanced stages). The second is the balance: the steady-state period
is set by the slowest stage, so every other stage idles for the difference.
"""
from __future__ import annotations

from typing import Sequence


def predicted_pipeline_efficiency(stage_costs: Sequence[float], num_micro_batches: int) -> float:
    """Fraction of the ideal (bubble-free, perfectly balanced) throughput; 1.0 at PP = 1 balanced."""
    if not stage_costs:
        raise ValueError("stage_costs is empty; give one cost per pipeline stage")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
    if min(stage_costs) < 0 or max(stage_costs) <= 0:
        raise ValueError(f"stage costs must be non-negative with a positive maximum, got {list(stage_costs)}")
    stages = len(stage_costs)
    bubble = num_micro_batches / (num_micro_batches + stages - 1)
    balance = (sum(stage_costs) / stages) / max(stage_costs)
    return bubble * balance
