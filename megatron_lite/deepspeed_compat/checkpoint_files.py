"""DeepSpeed's checkpoint files: their names, the classes they pickle, the engine's checkpoint IO, and which
layer (or tied module) owns a pipeline module's parameter."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from deepspeed.pipe import PipelineModule

from megatron_lite.deepspeed_compat.hooks import resolve


# Classes DeepSpeed's optimizers pickle into their checkpoint files (ZeRO / bf16 partition maps, the
# loss scaler, the ZeRO stage): plain data, allowed when loading with weights_only=True.
CHECKPOINT_CLASSES: Tuple[str, ...] = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


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


TIED_PREFIX = "tied_modules."


def pipeline_parameter_owner(name: str) -> Tuple[object, str]:
    """A PipelineModule parameter name -> (layer spec index, or the tied key for a tied module; the name
    inside that layer). Why: DeepSpeed names the stage's layers by their spec index (add_module(str(idx)))
    and tied modules `tied_modules.<key>`; ZeRO's `param_slice_mappings` use these names."""
    if name.startswith(TIED_PREFIX):
        key, rest = name[len(TIED_PREFIX):].split(".", 1)
        return key, rest
    index, rest = name.split(".", 1)
    return int(index), rest


def engine_parameters(module: PipelineModule) -> Dict[Tuple[object, str], torch.nn.Parameter]:
    """Every parameter of this rank's stage by (spec index or tied key, name inside the layer)."""
    return {pipeline_parameter_owner(name): p for name, p in module.named_parameters()}
