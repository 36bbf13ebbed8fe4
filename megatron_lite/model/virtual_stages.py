"""Which pipeline stages each pipeline rank holds, by --pipeline-schedule.

    1f1b       PP stages; rank r holds stage r.
    dualpipev  2 PP stages in a V (DeepSpeed's DualPipeV): rank r holds stage r, where micro-batches travel
               out towards the last rank, and stage 2 PP - 1 - r, where they travel back. Rank 0 holds the
               first and the last stage: it embeds and computes the loss, and the tied embedding and head are
               one module there.

Stages are cut from the layer specs as ever (model/partition.py, cost/stages.py), only 2 PP of them under
dualpipev; this module says where each one lives.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

SCHEDULES = ("1f1b", "dualpipev")


def stage_count(pp: int, schedule: str) -> int:
    """Stages the layer specs are cut into: PP, or 2 PP under dualpipev."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return 2 * pp if schedule == "dualpipev" else pp


def rank_stages(pp: int, schedule: str, rank: int) -> Tuple[int, ...]:
    """The stages pipeline rank `rank` holds, in the order its module builds them."""
    if not 0 <= rank < pp:
        raise ValueError(f"pipeline rank {rank} is not in 0..{pp - 1}")
    return (rank, 2 * pp - 1 - rank) if stage_count(pp, schedule) == 2 * pp else (rank,)


def rank_of_stage(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding `stage`."""
    return min(stage, 2 * pp - 1 - stage) if stage_count(pp, schedule) == 2 * pp else stage


def rank_ranges(bounds: Sequence[int], pp: int, schedule: str, rank: int) -> List[Tuple[int, int]]:
    """The spec ranges [start, stop) pipeline rank `rank` holds; bounds: the stage_count + 1 stage bounds."""
    if len(bounds) != stage_count(pp, schedule) + 1:
        raise ValueError(f"{len(bounds) - 1} stages for {pp} pipeline ranks under {schedule}")
    return [(bounds[s], bounds[s + 1]) for s in rank_stages(pp, schedule, rank)]
