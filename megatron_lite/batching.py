"""Batch-size arithmetic: global batch = micro batch x gradient-accumulation steps x DP.

The one place where these numbers are derived and checked, so DeepSpeed's own
assertions on them can never fire from our command line.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_lite.config import BatchConfig, ConfigError


def nearest_multiples(value: int, unit: int) -> List[int]:
    """The multiples of unit just below and above value (below only when positive)."""
    below = (value // unit) * unit
    above = below + unit
    return [v for v in (below, above) if v > 0 and v != value]


def or_join(values) -> str:
    return " or ".join(str(v) for v in values)


def resolve_batch(
    data_parallel_size: int,
    micro_batch_size: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    gradient_accumulation_steps: Optional[int] = None,
    rampup_batch_size: Optional[Tuple[int, int, int]] = None,
) -> BatchConfig:
    """Derive the missing one of (micro, global, gas) from the others and check that they agree.

    With only a micro batch, gas = 1 and global = micro x DP (Megatron-LM's default).
    With only a global batch, micro = 1.
    """
    dp = data_parallel_size
    for flag, value in (
        ("--micro-batch-size", micro_batch_size),
        ("--global-batch-size", global_batch_size),
        ("--gradient-accumulation-steps", gradient_accumulation_steps),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")

    micro, glob, gas = micro_batch_size, global_batch_size, gradient_accumulation_steps
    if micro is None and (glob is None or gas is None):
        micro = 1
    if micro is None:
        unit = gas * dp
        if glob % unit:
            raise ConfigError(
                f"--global-batch-size {glob} is not divisible by --gradient-accumulation-steps {gas} "
                f"x data-parallel size {dp} = {unit}, so no micro batch size fits; "
                f"use --global-batch-size {or_join(nearest_multiples(glob, unit))}", code="batch_not_divisible"
            )
        micro = glob // unit
    unit = micro * dp
    if glob is None:
        glob = unit * (gas or 1)
    if glob % unit:
        raise ConfigError(
            f"--global-batch-size {glob} is not divisible by --micro-batch-size {micro} "
            f"x data-parallel size {dp} = {unit}; use --global-batch-size "
            f"{or_join(nearest_multiples(glob, unit))}", code="batch_not_divisible"
        )
    derived_gas = glob // unit
    if gas is not None and gas != derived_gas:
        raise ConfigError(
            f"--gradient-accumulation-steps {gas} disagrees with --global-batch-size {glob} / "
            f"(--micro-batch-size {micro} x data-parallel size {dp}) = {derived_gas}; "
            f"drop --gradient-accumulation-steps or use --global-batch-size {gas * unit}"
        )
    if rampup_batch_size is not None:
        _check_rampup(rampup_batch_size, glob, unit, micro, dp)
    return BatchConfig(
        micro_batch_size=micro,
        global_batch_size=glob,
        gradient_accumulation_steps=derived_gas,
        rampup_batch_size=tuple(rampup_batch_size) if rampup_batch_size else None,
    )


def _check_rampup(rampup, global_batch_size: int, unit: int, micro: int, dp: int) -> None:
    start, increment, samples = rampup
    flag = "--rampup-batch-size"
    if start < 1 or increment < 1 or samples < 1:
        raise ConfigError(f"{flag} {start} {increment} {samples}: all three values must be at least 1")
    for name, value in (("start", start), ("increment", increment)):
        if value % unit:
            raise ConfigError(
                f"{flag} {name} {value} is not divisible by --micro-batch-size {micro} x data-parallel "
                f"size {dp} = {unit}, so some step's batch would not split into micro-batches; "
                f"use {or_join(nearest_multiples(value, unit))}", code="batch_not_divisible"
            )
    if start > global_batch_size:
        raise ConfigError(
            f"{flag} start {start} is larger than --global-batch-size {global_batch_size}; "
            f"use a start of at most {global_batch_size}"
        )
    if (global_batch_size - start) % increment:
        raise ConfigError(
            f"{flag}: --global-batch-size {global_batch_size} - start {start} = "
            f"{global_batch_size - start} is not divisible by increment {increment}; "
            f"use an increment that divides {global_batch_size - start}, e.g. {unit}"
        )


def global_batch_size_at(batch: BatchConfig, consumed_samples: int) -> int:
    """The global batch size in force once `consumed_samples` samples have been trained on.

    Ramp-up (Megatron-LM semantics): start at `start`, add `increment` after each
    `ramp_samples / number_of_increments` samples, until the full global batch.
    """
    if batch.rampup_batch_size is None:
        return batch.global_batch_size
    start, increment, ramp_samples = batch.rampup_batch_size
    increments = (batch.global_batch_size - start) // increment
    if increments == 0:
        return batch.global_batch_size
    samples_per_increment = ramp_samples / increments
    steps = int(consumed_samples / samples_per_increment)
    return min(start + steps * increment, batch.global_batch_size)


def gradient_accumulation_steps_at(batch: BatchConfig, data_parallel_size: int, consumed_samples: int) -> int:
    """Micro-batches per DP rank for the step that starts at `consumed_samples`."""
    return global_batch_size_at(batch, consumed_samples) // (batch.micro_batch_size * data_parallel_size)
