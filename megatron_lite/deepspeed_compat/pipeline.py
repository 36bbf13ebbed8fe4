"""DeepSpeed's pipeline module and engine: our stage split, the layer files a rank loads, tied copies, and the
wrappers around the engine's instructions (timing, the gradient reduction, the last stage's outputs)."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule


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

    def run_stage(self, functions: Sequence[Callable], x):
        """x through this stage's layer functions in order; a subclass may recompute some of them."""
        for fn in functions:
            x = fn(x)
        return x

    def forward(self, forward_input):
        # Why: DeepSpeed's forward checkpoints fixed chunks of `activation_checkpoint_interval`
        # functions counted from the stage's first one (embedding and head included), with its own
        # checkpoint function; Megatron-LM's --recompute-method chunks a stage's transformer layers,
        # and our checkpoint must replay our dropout streams. With the interval 0 we pass, DeepSpeed's
        # forward only runs `forward_funcs` in order (its per-layer seeding is off), as run_stage does.
        return self.run_stage(list(self.forward_funcs), forward_input)

    def _synchronize_tied_weights(self) -> None:
        # Why: DeepSpeed broadcasts the tied parameters in place with autograd on, which records
        # the broadcast in the graph and makes every backward warn about it.
        with torch.no_grad():
            super()._synchronize_tied_weights()


def is_dualpipev(engine_or_module) -> bool:
    """Whether a pipeline engine (or module) runs DeepSpeed's DualPipeV schedule."""
    return isinstance(engine_or_module, (DualPipeVEngine, DualPipeVModule))


def stage_layer_functions(module) -> List[Tuple[int, list]]:
    """(first spec index, layer functions) of each stage this rank's pipeline module holds: one under 1F1B, two
    under DualPipeV (its `phase_bounds` and `phase_funcs`, phase 0 first)."""
    if isinstance(module, DualPipeVModule):
        return [(start, list(functions)) for (start, _), functions in zip(module.phase_bounds, module.phase_funcs)]
    return [(module._local_start, list(module.forward_funcs))]


def layer_file_modules(module: PipelineModule) -> Dict[int, torch.nn.Module]:
    """Spec index -> the module whose state dict is that spec's layer file on this rank.

    Why: a resume checks each file against what this rank will load it into. DeepSpeed's save_state_dict
    and load_state_dir pair `forward_funcs[i]` with layer `_local_start + i`, and skip entries without a
    state dict (a tied head is a function of the embedding module, which has the file); under DualPipeV they
    do so for each of the rank's two stages (stage_layer_functions)."""
    return {start + i: f for start, functions in stage_layer_functions(module) for i, f in enumerate(functions)
            if hasattr(f, "state_dict")}


def is_pipe_replicated_copy(param: torch.Tensor) -> bool:
    """Whether DeepSpeed marked `param` as a tied weight's copy on a stage that does not own it.
    Why: such a copy holds the same gradient as the owner's after the tied all-reduce; a global
    norm must count it once."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def skip_gradient_all_reduce(engine) -> None:
    """Replace the pipeline engine's gradient all-reduce with its one other effect; for a ZeRO-0
    engine whose data-parallel group is this rank alone, where the all-reduce is an identity.

    Why: DeepSpeed still flattens every gradient into one buffer, all-reduces it over the group
    of one and copies it back (measured at TP = PP = DP = 1, 3.7M parameters on 2 CPU cores:
    3-5 ms of a 300 ms step, and ~700 page faults for the fresh buffer; benchmarks/bench_single_peers.py).
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
                               for cls, method in engine._INSTRUCTION_MAP.items()}
    # After the schedule the loss is broadcast from the last stage: other stages wait there.
    aggregate = timed("AggregateLoss", type(engine)._aggregate_total_loss)
    engine._aggregate_total_loss = lambda: aggregate(engine)


# Sequence parallelism and the last pipeline stage's outputs (issue 23). Both wrap one instruction of this
# engine's instance-level `_INSTRUCTION_MAP` (as time_pipeline_instructions does, and composing with it).

def wrap_instruction(engine, instruction: str, wrap: Callable[[Callable], Callable]) -> None:
    from deepspeed.runtime.pipe import schedule

    cls = getattr(schedule, instruction)
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, cls: wrap(engine._INSTRUCTION_MAP[cls])}


def instruction_hooks(engine) -> tuple:
    """The engine's pipeline instructions as every wrap_instruction so far left them, and the loss broadcast that
    ends a step as time_pipeline_instructions left it, to hand back to use_instruction_hooks (a benchmark switches
    one engine between two sets of hooks)."""
    return engine._INSTRUCTION_MAP, engine.__dict__.get("_aggregate_total_loss")


def use_instruction_hooks(engine, hooks: tuple) -> None:
    """Why the loss broadcast too: it is not an instruction of the map, and time_pipeline_instructions times it
    on the instance; switching the map alone left it timed on both sides."""
    engine._INSTRUCTION_MAP, aggregate = hooks
    if aggregate is not None:
        engine._aggregate_total_loss = aggregate
    else:
        engine.__dict__.pop("_aggregate_total_loss", None)


def before_gradient_reduction(engine, run: Callable[[], None]) -> None:
    """Call run() once per pipeline step, after the step's last backward and before DeepSpeed reduces any
    gradient (the tied weights' all-reduce, then the data-parallel reduction).

    Why: sequence-parallel (and QK-norm) gradients are summed over TP there, once per step as Megatron-LM
    does in finalize_model_grads. The pipeline schedule (pipe/schedule.py TrainSchedule) runs ReduceTiedGrads,
    ReduceGrads, OptimizerStep after the last BackwardPass; the engine exposes no hook in between."""
    def wrap(reduce_tied_grads):
        def run_first(self, **kwargs):
            run()
            return reduce_tied_grads(self, **kwargs)
        return run_first

    wrap_instruction(engine, "ReduceTiedGrads", wrap)


def accumulated_gradient(engine, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The tensor holding param's gradient summed over the step's micro-batches, at the point
    before_gradient_reduction runs, or None when it has none."""
    return getattr(param, accumulated_gradient_attribute(engine), None)


def accumulated_gradient_attribute(engine) -> str:
    """The parameter attribute accumulated_gradient reads: the same for every parameter of an engine, all its life.

    Why: under the bf16 optimizer the sum accumulates in an fp32 buffer the engine links as
    `param._hp_grad` (DeepSpeed's own tied-weight reduction reads it there); ZeRO 1 with a
    gradient-accumulation dtype other than the weights' keeps it in `param.grad_accum`; otherwise
    `param.grad`."""
    if engine.using_bf16_optimizer:
        return "_hp_grad"
    if getattr(engine.optimizer, "use_grad_accum_attribute", False):
        return "grad_accum"
    return "grad"


def free_last_stage_outputs_after_backward(engine) -> None:
    """Drop the last stage's forward outputs (the [b, s, V/tp] logits) once their backward has run.

    Why: DeepSpeed 0.19's `_exec_backward_pass` returns early on the last stage, before the lines that
    clear `pipe_buffers['outputs']` on the other stages, so the logits of up to num_pipe_buffers (2)
    micro-batches stay alive through the next forward and the optimizer step. Nothing reads them after
    their backward: on the last stage the outputs are not sent, and eval_batch keeps what it returns
    in `engine.outputs`, not in the pipe buffer. DeepSpeed's DualPipeVEngine clears every stage's outputs after
    their backward itself (and its BackwardPass takes a phase): nothing to do there."""
    if is_dualpipev(engine):
        return

    def wrap(backward):
        def backward_then_free(self, buffer_id):
            result = backward(self, buffer_id=buffer_id)
            if self.is_last_stage():
                self.pipe_buffers["outputs"][buffer_id] = None
            return result
        return backward_then_free

    wrap_instruction(engine, "BackwardPass", wrap)
