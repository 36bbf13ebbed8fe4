"""Every use of DeepSpeed beyond its documented API, in one place.

Each hook says why we need it. `HOOKS` lists what each hook relies on in the
installed DeepSpeed (`tests/test_deepspeed_compat.py` checks every entry), so an
upgrade that moves one fails a named test instead of training wrongly.
setup.py pins DeepSpeed to the range these were checked against.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.pipe import PipelineModule

# (object path, what we rely on): a method's parameter names, or "attribute" for a value we read.
HOOKS: Tuple[Tuple[str, str], ...] = (
    ("deepspeed.runtime.pipe.module.PipelineModule._partition_layers", "self, method"),
    ("deepspeed.runtime.pipe.module.PipelineModule._set_bounds", "self, start, stop"),
    ("deepspeed.runtime.pipe.module.PipelineModule._synchronize_tied_weights", "self"),
    ("deepspeed.runtime.pipe.module.PipelineModule.stage_id", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule.parts", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule.forward_funcs", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule._local_start", "attribute"),
    ("deepspeed.runtime.pipe.module.PipelineModule.ds_pipe_replicated", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.skipped_steps", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.was_step_applied", "self"),
    ("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer.loss_scale", "attribute"),
    ("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer.optimizer", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._INSTRUCTION_MAP", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_schedule", "self, pipe_schedule"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._aggregate_total_loss", "self"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.checkpoint_engine", "attribute"),
    ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine.load", "self, path, map_location"),
    ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine.save", "self, state_dict, path"),
    ("deepspeed.runtime.engine.DeepSpeedEngine._get_rank_zero_ckpt_name",
     "self, checkpoints_path, tag, mp_rank, dp_rank, bf16_mode"),
    ("deepspeed.runtime.pipe.module.PipelineModule.ckpt_layer_path", "self, ckpt_dir, local_layer_idx"),
    ("deepspeed.runtime.engine.DeepSpeedEngine._get_ckpt_name", "self, checkpoints_path, tag"),
)

# Classes DeepSpeed's optimizers pickle into their checkpoint files (ZeRO / bf16 partition maps, the
# loss scaler, the ZeRO stage): plain data, allowed when loading with weights_only=True.
CHECKPOINT_CLASSES: Tuple[str, ...] = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
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


def layer_file_modules(module: PipelineModule) -> Dict[int, torch.nn.Module]:
    """Spec index -> the module whose state dict is that spec's layer file on this rank.

    Why: a resume checks each file against what this rank will load it into. DeepSpeed's save_state_dict
    and load_state_dir pair `forward_funcs[i]` with layer `_local_start + i`, and skip entries without a
    state dict (a tied head is a function of the embedding module, which has the file)."""
    return {module._local_start + i: f for i, f in enumerate(module.forward_funcs) if hasattr(f, "state_dict")}


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


def layer_file_name(spec: int, tp_rank: int) -> str:
    """The file DeepSpeed's pipeline module writes for layer spec `spec` on TP rank `tp_rank`
    (PipelineModule.ckpt_layer_path with our topology's 'model' axis; named by the spec's index in the
    whole model, so these names do not depend on the stage split)."""
    return f"layer_{spec:02d}-model_{tp_rank:02d}-model_states.pt"


def model_states_file_name(stage: int, tp_rank: int, tp: int) -> str:
    """The engine's per-rank file (optimizer at ZeRO 0, LR schedule, step counters): one per stage and
    TP rank; DeepSpeed numbers them by the pipeline engine's model-parallel rank, stage x TP + tp_rank."""
    return f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"


def zero_optimizer_file_name(dp_rank: int, stage: int, tp_rank: int, tp: int, bf16: bool) -> str:
    """One ZeRO (or bf16-optimizer) partition file per DP rank and model-parallel rank
    (DeepSpeedEngine._get_rank_zero_ckpt_name)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{stage * tp + tp_rank:02d}_optim_states.pt"


def zero_optimizer_file_pattern(stage: int, tp_rank: int, tp: int) -> str:
    """A glob for every DP rank's ZeRO (or bf16-optimizer) partition file of one model-parallel rank."""
    return f"*zero_pp_rank_*_mp_rank_{stage * tp + tp_rank:02d}_optim_states.pt"


def zero3_model_states_file_name(dp_rank: int) -> str:
    """At ZeRO 3 each DP rank has its own model-states file (DeepSpeedEngine._get_ckpt_name)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"


def checkpoint_safe_globals() -> list:
    """The classes of CHECKPOINT_CLASSES, for torch.serialization.safe_globals."""
    return [resolve(path) for path in CHECKPOINT_CLASSES]


def install_checkpoint_io(engine, io) -> None:
    """Make the engine read every checkpoint file through `io.load(path)` and write through
    `io.save(obj, path)` / `io.makedirs(path, exist_ok)`.

    Why: DeepSpeed's TorchCheckpointEngine loads with weights_only=False (a pickle in a checkpoint runs
    code) and a failed write raises in the middle of a save whose other ranks then wait in its closing
    barrier. The engine, its pipeline module and its ZeRO loader all go through `engine.checkpoint_engine`,
    an object set in `_configure_checkpointing`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class OurCheckpointIO(TorchCheckpointEngine):
        def __init__(self):
            self.name = "megatron_lite"  # TorchCheckpointEngine.__init__ only logs and reads a config flag
            self.zipfile_serialization = True

        def load(self, path, map_location=None):
            return io.load(path)

        def save(self, state_dict, path):
            io.save(state_dict, path)

        def makedirs(self, path, exist_ok=False):
            io.makedirs(path, exist_ok=exist_ok)

    engine.checkpoint_engine = OurCheckpointIO()


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
