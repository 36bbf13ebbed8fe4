"""The progress watchdog's section: a monitor process per node that ends a run whose rank stopped making progress
(training/watchdog.py); NVIDIA resiliency extension's idea, Megatron-LM-style flag names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config.option import option

WATCHDOG_TIMEOUT_MAX_MINUTES = 10 ** 7
"""Any watchdog timeout at most this (19 years): past it a value is a typo, not a plan."""


@dataclass(frozen=True)
class WatchdogConfig:
    watchdog: bool = option(True, "--watchdog", action="boolean_optional")
    """A monitor process per node (started by local rank 0) reads each rank's progress; a rank that stays in one
    phase past its timeout gets every local rank's Python stack printed, a line naming it, and the node's ranks
    ended with exit code 42 (megatron_lite/exit_codes.py). --no-watchdog: none."""
    watchdog_startup_timeout_minutes: float = option(30.0, "--watchdog-startup-timeout-minutes", above=0,
                                                     maximum=WATCHDOG_TIMEOUT_MAX_MINUTES)
    """Start-up (imports, process groups, model, --load, data) at most this long; also the timeout of every other
    phase until it has been timed 5 times (compilation and warm-up make first steps slow)."""
    watchdog_step_timeout_minutes: Optional[float] = option(None, "--watchdog-step-timeout-minutes", above=0,
                                                            maximum=WATCHDOG_TIMEOUT_MAX_MINUTES)
    """A training step's phases (loading a micro-batch, forward-backward, the optimizer step) each at most this
    long. Default: calibrated, --watchdog-timeout-factor x the longest time the phase took so far, at least
    --watchdog-min-timeout-minutes."""
    watchdog_checkpoint_timeout_minutes: Optional[float] = option(
        None, "--watchdog-checkpoint-timeout-minutes", above=0, maximum=WATCHDOG_TIMEOUT_MAX_MINUTES)
    """A save (or the wait for the async save in flight) at most this long. Default: calibrated as the step's."""
    watchdog_evaluation_timeout_minutes: Optional[float] = option(
        None, "--watchdog-evaluation-timeout-minutes", above=0, maximum=WATCHDOG_TIMEOUT_MAX_MINUTES)
    """An evaluation at most this long. Default: calibrated as the step's."""
    watchdog_timeout_factor: float = option(5.0, "--watchdog-timeout-factor", minimum=1, maximum=10 ** 6)
    """A calibrated timeout is this many times the phase's longest observed time (NVRx uses 5)."""
    watchdog_min_timeout_minutes: float = option(5.0, "--watchdog-min-timeout-minutes", above=0,
                                                 maximum=WATCHDOG_TIMEOUT_MAX_MINUTES)
    """A calibrated timeout is at least this long: a phase of milliseconds must not end a run for one slow read."""
