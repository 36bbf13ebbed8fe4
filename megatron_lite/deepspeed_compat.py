"""Every use of DeepSpeed beyond its documented API, in one place.

Each hook says why we need it. `HOOKS` lists what each hook relies on in the
installed DeepSpeed (`tests/test_deepspeed_compat.py` checks every entry), so an
upgrade that moves one fails a named test instead of training wrongly.
setup.py pins DeepSpeed to the range these were checked against.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from deepspeed.pipe import PipelineModule

# (object path, what we rely on): a method's parameter names, or "attribute" for a value we read.
HOOKS: Tuple[Tuple[str, str], ...] = (
    ("deepspeed.runtime.pipe.module.PipelineModule._partition_layers", "self, method"),
    ("deepspeed.runtime.pipe.module.PipelineModule._set_bounds", "self, start, stop"),
    ("deepspeed.runtime.pipe.module.PipelineModule._synchronize_tied_weights", "self"),
    ("deepspeed.runtime.pipe.module.PipelineModule.stage_id", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule.parts", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule.ds_pipe_replicated", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.skipped_steps", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.was_step_applied", "self"),
    ("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer.loss_scale", "attribute"),
    ("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer.optimizer", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._INSTRUCTION_MAP", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_schedule", "self, pipe_schedule"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._aggregate_total_loss", "self"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_reduce_grads", "self"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.allreduce_gradients", "attribute"),  # wrapped: (*args, **kwargs)
)


class OwnPartitionPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries come from `stage_boundaries()` instead of
    DeepSpeed's partitioners.

    Why: DeepSpeed's `_partition_layers` knows uniform / parameters / type:regex only, and
    'parameters' builds every layer on every rank to count them. Overriding it is how
    Megatron-DeepSpeed and GPT-NeoX steer the split too; `_set_bounds` is DeepSpeed's own way
    to say which layers this rank builds.
    """

    def stage_boundaries(self, num_stages: int) -> List[int]:
        raise NotImplementedError  # a subclass says where its stages start

    def _partition_layers(self, method: str = "uniform") -> None:
        # DeepSpeed sets stage_id (this rank's stage) before it calls _partition_layers.
        self.parts = list(self.stage_boundaries(self.num_stages))
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _synchronize_tied_weights(self) -> None:
        # Why: DeepSpeed broadcasts the tied parameters in place with autograd on, which records
        # the broadcast in the graph and makes every backward warn about it.
        with torch.no_grad():
            super()._synchronize_tied_weights()


def is_pipe_replicated_copy(param: torch.Tensor) -> bool:
    """Whether DeepSpeed marked `param` as a tied weight's copy on a stage that does not own it.
    Why: such a copy holds the same gradient as the owner's after the tied all-reduce; a global
    norm must count it once."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer we passed in, under DeepSpeed's fp16 / bf16 / ZeRO wrapper (if any).
    Why: our ClippedAdamW records the gradient norm it clipped with."""
    return getattr(optimizer, "optimizer", optimizer)


def loss_scale(optimizer) -> Optional[float]:
    """The current fp16 loss scale, or None without loss scaling. DeepSpeed's fp16 optimizers
    expose it as the `loss_scale` property (the `cur_scale` attribute is gone since 0.18.6)."""
    value = getattr(optimizer, "loss_scale", None)
    return None if value is None else float(value)


def skipped_steps(engine) -> int:
    """Optimizer steps DeepSpeed skipped after an fp16 overflow, over the run (the engine's counter,
    saved in its checkpoints)."""
    return int(getattr(engine, "skipped_steps", 0))


def skip_gradient_all_reduce(engine) -> None:
    """Replace the pipeline engine's gradient all-reduce with its one other effect; for a ZeRO-0
    engine whose data-parallel group is this rank alone, where the all-reduce is an identity.

    Why: DeepSpeed still flattens every gradient into one buffer, all-reduces it over the group
    of one and copies it back (measured at TP = PP = DP = 1, 3.7M parameters on 2 CPU cores:
    3-5 ms of a 300 ms step, and ~700 page faults for the fresh buffer; tools/bench_single_peers.py).
    Its other effect is kept: a parameter without a gradient (the last stage's copy of the tied
    embedding module holds an unused position table) gets a zero gradient, so AdamW keeps moments
    for it and decays it exactly as at DP > 1, and checkpoints hold the same optimizer states.
    ZeRO 0 only: ZeRO 1's reduce_gradients also fills the optimizer's flat partitions."""
    def zero_missing_gradients(bucket_size=None):
        for param in engine.module.parameters():
            if param.requires_grad and param.numel() and param.grad is None:
                param.grad = torch.zeros_like(param)

    engine.allreduce_gradients = zero_missing_gradients


def time_pipeline_instructions(engine, record: Callable[[str, float], None], synchronize: Callable[[], None]) -> None:
    """Call record(instruction name, seconds) after every instruction the pipeline engine runs
    (ForwardPass, BackwardPass, SendActivation, RecvGrad, OptimizerStep, ...) and after the
    loss broadcast that ends each step (AggregateLoss).

    Why: DeepSpeed's own wall_clock_breakdown timers report the whole job's forward and
    backward, not each stage's time blocked in send/recv. `_exec_schedule` looks each
    instruction up in `self._INSTRUCTION_MAP`, so an instance-level map of timed wrappers
    times this engine only. `synchronize` waits for the device so GPU kernels are counted
    in the instruction that launched them."""
    def timed(name, method):
        def run(self, **kwargs):
            start = time.perf_counter()
            result = method(self, **kwargs)
            synchronize()
            record(name, time.perf_counter() - start)
            return result
        return run

    engine._INSTRUCTION_MAP = {cls: timed(cls.__name__, method)
                               for cls, method in type(engine)._INSTRUCTION_MAP.items()}
    # After the schedule the loss is broadcast from the last stage: other stages wait there.
    aggregate = timed("AggregateLoss", type(engine)._aggregate_total_loss)
    engine._aggregate_total_loss = lambda: aggregate(engine)


def resolve(path: str):
    """The object a HOOKS path names, or raise AttributeError/ImportError saying which part is missing."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def parameter_names(function) -> Sequence[str]:
    import inspect

    return list(inspect.signature(function).parameters)
