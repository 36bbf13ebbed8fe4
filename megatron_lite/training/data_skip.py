"""--iterations-to-skip: a step whose global batch is read and not trained on (Megatron-LM's flag).

Megatron-LM runs a dummy step for such an iteration: the micro-batches are drawn from the iterator, nothing is
computed, the iteration and the consumed samples advance, the optimizer and its schedule do not. Here the same,
with no engine call at all: a rank reads the micro-batches its engine would have read (gas of them: DeepSpeed's
pipeline engine reads on its first and last stages only, and the other stages' iterators are never read, so
their position does not matter), which keeps every rank's data position where an uninterrupted run's would be.
"""
from __future__ import annotations

from typing import Iterator


def skip_step(data_iter: Iterator, micro_batches: int) -> None:
    """Read and drop one step's micro-batches from this rank's iterator."""
    for _ in range(micro_batches):
        next(data_iter)


def micro_batches_per_step(step_batch: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Micro-batches each data-parallel rank reads for a step of `step_batch` samples."""
    return step_batch // (micro_batch_size * data_parallel_size)
