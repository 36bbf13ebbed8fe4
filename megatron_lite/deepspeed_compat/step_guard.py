"""The numerical guard's places in DeepSpeed's pipeline engine: each rank's own loss and gradients before any
reduction, an optimizer step left out on every rank, and the loss function a fault injection corrupts.

training/numerical_guard.py decides; this module only reaches into the engine."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from megatron_lite.deepspeed_compat.pipeline import (accumulated_gradient_attribute, before_gradient_reduction,
                                                     wrap_instruction)


def local_loss_sum(engine) -> Optional[torch.Tensor]:
    """The sum of this rank's micro-batch losses so far in the step (DeepSpeed's `total_loss`), on a rank that
    computes the loss; None elsewhere. Read before the reduction, it is this rank's own."""
    total = engine.total_loss
    return total if isinstance(total, torch.Tensor) else None


class LocalGradients:
    """Called at before_gradient_reduction, once per step: this rank's accumulated gradients
    (pipeline.accumulated_gradient), its parameters and the attribute holding their sums found once.

    Why: the guard reads them on the step's critical path, where finding them per parameter per step took 0.29 ms
    for 38 parameters on a CPU core (measured in place, docs/benchmarks.md), a fifth of the guard's cost there."""

    def __init__(self, engine):
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.attribute = accumulated_gradient_attribute(engine)

    def __call__(self) -> List[torch.Tensor]:
        grads = (getattr(p, self.attribute, None) for p in self.params)
        return [g for g in grads if g is not None and g.numel()]


def check_before_gradient_reduction(engine, measure: Callable[[], None]) -> None:
    """measure() once per step before DeepSpeed (or our TP sums, registered earlier) reduces any gradient:
    before_gradient_reduction runs the hook registered last first."""
    before_gradient_reduction(engine, measure)


def skip_optimizer_step_when(engine, skip: Callable[[], bool]) -> None:
    """Replace the pipeline's OptimizerStep, on the steps where skip() is true, with what DeepSpeed's own
    `_take_model_step` does for an fp16 step that overflowed: the step's gradients cleared, the step counted
    (global_steps, global_samples) and counted as skipped (skipped_steps), no optimizer update and no
    learning-rate scheduler step. skip() must answer the same on every rank (it is decided after an
    all-reduce), so no rank enters the optimizer's collectives (ZeRO 1's all-gather) alone.

    Why: weights, optimizer moments and the schedule stay as if the step had not happened, and the engine's
    counters as after a skipped fp16 step, which a checkpoint and a resume already handle."""
    def wrap(optimizer_step):
        def step_or_skip(self, **kwargs):
            if not skip():
                return optimizer_step(self, **kwargs)
            _clear_gradients(self)
            self._step_applied = False
            self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        return step_or_skip

    wrap_instruction(engine, "OptimizerStep", wrap)


def _clear_gradients(engine) -> None:
    """The gradients of a step that will not be applied, cleared as DeepSpeed clears them after an overflow:
    ZeRO 1's optimizer also drops its reduced partitions (stage_1_and_2.py step()), the bf16 optimizer its fp32
    accumulation buffers, the plain optimizer the parameters' .grad."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.zero_grad(set_to_none=True)
        if optimizer.cpu_offload:
            optimizer.reset_cpu_buffers()
        else:
            for key in optimizer.averaged_gradients.keys():
                optimizer.averaged_gradients[key] = None
    elif engine.bfloat16_enabled() or engine.fp16_enabled():
        optimizer.zero_grad()
    else:
        engine.zero_grad()


def wrap_loss_function(engine, wrap: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The pipeline's loss becomes wrap(loss) on this rank, before its backward (fault injection: a corrupted
    loss corrupts the gradients of every stage behind it, as a real one would)."""
    module = engine.module
    loss_fn = module.loss_fn
    module.loss_fn = lambda outputs, labels: wrap(loss_fn(outputs, labels))


STEP_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
"""What a pipeline step changes in the engine besides the weights, the optimizer and the schedule, which a step
left out (skip_optimizer_step_when) does not touch."""


def step_counters(engine) -> Tuple[int, ...]:
    return tuple(getattr(engine, name) for name in STEP_COUNTERS)


def restore_step_counters(engine, counters: Tuple[int, ...]) -> None:
    """The counters as step_counters read them: a step left out and then replayed (training/rerun.py) counts
    once."""
    for name, value in zip(STEP_COUNTERS, counters):
        setattr(engine, name, value)
