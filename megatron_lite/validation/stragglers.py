"""--log-straggler and the slow-rank drill hook, checked before any process group exists.

MEGATRON_LITE_INJECT_SLOW=RANK:SECONDS makes one global rank sleep SECONDS per training step, inside its
forward passes (training/stragglers.py), so that tests and drills can check that the straggler report, the
collective timeout or a watchdog name that rank. A typo there would run a drill that proves nothing, so a
value that does not parse, or names a rank the job does not have, stops the run like a bad flag does.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple

from megatron_lite.config import Config, ConfigError

INJECT_SLOW = "MEGATRON_LITE_INJECT_SLOW"


def parse_inject_slow(text: Optional[str], world_size: int) -> Optional[Tuple[int, float]]:
    """(rank, seconds per step) from the variable's value; None when unset or empty."""
    if not text:
        return None
    rank_text, _, seconds_text = text.partition(":")
    try:
        rank, seconds = int(rank_text), float(seconds_text)
    except ValueError:
        rank, seconds = -1, math.nan
    if not 0 <= rank < world_size or not 0 <= seconds < math.inf:
        raise ConfigError(f"{INJECT_SLOW}={text!r} must be RANK:SECONDS with a rank from 0 to {world_size - 1} and "
                          f"a non-negative number of seconds slept per step, e.g. {world_size - 1}:0.5",
                          code="inject_slow")
    return rank, seconds


def inject_slow(world_size: int) -> Optional[Tuple[int, float]]:
    return parse_inject_slow(os.environ.get(INJECT_SLOW), world_size)


def straggler_rules(config: Config, notes: List[str]) -> Config:
    if config.logging.log_straggler and config.parallel.zero_stage >= 2:
        raise ConfigError(f"--log-straggler tells work from waiting by the pipeline engine's instructions, which "
                          f"--zero-stage {config.parallel.zero_stage} does not use; use --zero-stage 0 or 1, or drop "
                          f"the flag", code="straggler_zero")
    slow = inject_slow(config.parallel.world_size)
    if slow is not None and config.parallel.zero_stage >= 2:
        raise ConfigError(f"{INJECT_SLOW} sleeps in the pipeline engine's forward passes, which --zero-stage "
                          f"{config.parallel.zero_stage} does not use; use --zero-stage 0 or 1", code="inject_slow")
    if slow is not None:
        notes.append(f"drill: {INJECT_SLOW} makes rank {slow[0]} sleep {slow[1]:g}s per step")
    return config
