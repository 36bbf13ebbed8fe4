"""Every use of DeepSpeed beyond its documented API, in one place.

Each hook says why we need it. `HOOKS` lists what each hook relies on in the
installed DeepSpeed (`tests/test_deepspeed_compat.py` checks every entry), so an
upgrade that moves one fails a named test instead of training wrongly.
setup.py pins DeepSpeed to the range these were checked against.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

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
    ("deepspeed.runtime.pipe.module.PipelineModule.tied_modules", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.global_steps", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.global_samples", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.bit16_groups", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.single_partition_of_fp32_groups", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.loss_scaler", "attribute"),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.bf16_groups", "attribute"),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.fp32_groups_flat_partition", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.real_dp_process_group", "attribute"),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.real_dp_process_group", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer._optimizer_step", "self, group_no"),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer._load_legacy_checkpoint", "self, state_dict_list"),
    ("deepspeed.utils.tensor_fragment.tensor_fragment.set_optim_state_fragment",
     "self, flat_hp_partition, optim_fragment"),
    ("deepspeed.utils.logging.set_log_level_from_string", "log_level_str, custom_logger"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_reduce_grads", "self"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.allreduce_gradients", "attribute"),  # wrapped: (*args, **kwargs)
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.scaled_global_norm", "self, norm_type"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.model_parallel_group", "attribute"),
    ("deepspeed.runtime.utils.combine_grad_norm_groups", "norm_groups, norm_type"),
    # Sequence parallelism, recompute and the last stage's outputs (issue 23; functions at the end).
    ("deepspeed.runtime.pipe.module.PipelineModule.forward", "self, forward_input"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_backward_pass", "self, buffer_id"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_reduce_tied_grads", "self"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine.pipe_buffers", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine.using_bf16_optimizer", "attribute"),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer._hp_grad", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.use_grad_accum_attribute", "attribute"),
    # --distributed-timeout-minutes for DeepSpeed's own process groups (new_groups_time_out_after).
    ("deepspeed.comm.comm.cdb", "attribute"),
    ("deepspeed.comm.torch.TorchBackend.new_group", "self, ranks"),
    # Mixture of Experts (issue 45): DeepSpeed's expert groups, parameter marks and optimizer groups.
    ("deepspeed.utils.groups._EXPERT_PARALLEL_GROUP", "attribute"),
    ("deepspeed.utils.groups._EXPERT_PARALLEL_GROUP_RANKS", "attribute"),
    ("deepspeed.utils.groups._EXPERT_DATA_PARALLEL_GROUP", "attribute"),
    ("deepspeed.utils.groups._EXPERT_DATA_PARALLEL_GROUP_RANKS", "attribute"),
    ("deepspeed.moe.utils.is_moe_param", "param"),
    ("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer", "param_groups, max_group_size"),
    ("deepspeed.runtime.engine.MoE", "module name"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.has_moe_layers", "attribute"),
)

# Classes DeepSpeed's optimizers pickle into their checkpoint files (ZeRO / bf16 partition maps, the
# loss scaler, the ZeRO stage): plain data, allowed when loading with weights_only=True.
CHECKPOINT_CLASSES: Tuple[str, ...] = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)

# (function, text): start-up lines DeepSpeed writes with print(), not its logger, that quiet_prints hides.
STARTUP_PRINTS: Tuple[Tuple[str, str], ...] = (
    ("deepspeed.comm.torch.build_shm_op", "built successfully"),
    ("deepspeed.runtime.pipe.module.PipelineModule.__init__", "SEED_LAYERS="),
    ("deepspeed.runtime.pipe.topology.PipelineParallelGrid.__init__", "Using topology:"),
)
VERBOSE_LEVELS = ("debug", "info")


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


# Optimizer state by parameter: read out of DeepSpeed's partition files and written into a live engine, so a
# checkpoint moves to any TP / PP / DP, ZeRO 0 or 1 and precision (checkpoint/layout_free.py).

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


@dataclass
class PartitionFragments:
    """One DP rank's optimizer partition file, by parameter: flat fragments of the fp32 master and the Adam
    moments (a parameter split over DP ranks has a fragment in each, in DP-rank order), the step of each
    parameter's group, and the loss scaler's state (plain values)."""
    fragments: Dict[str, Dict[str, Optional[torch.Tensor]]]
    steps: Dict[str, Optional[float]]
    loss_scaler: Optional[Dict[str, object]]


def partition_fragments(state: dict) -> PartitionFragments:
    """Why: ZeRO 1/2 (zero/stage_1_and_2.py) and the bf16 optimizer (bf16_optimizer.py) save flat,
    DP-partitioned fp32 buffers: `single_partition_of_fp32_groups[g]` (the master), `base_optimizer_state`
    (the torch optimizer's state of those flat buffers, one per group: exp_avg, exp_avg_sq, step) and
    `param_slice_mappings[g]` (parameter name -> fragment_address(numel, start) in this rank's partition)."""
    saved = state["optimizer_state_dict"]
    masters = saved["single_partition_of_fp32_groups"]
    base = saved["base_optimizer_state"]
    per_group = base["state"] if isinstance(base, dict) else dict(enumerate(base))
    fragments, steps = {}, {}
    for group, mapping in enumerate(saved["param_slice_mappings"]):
        moments = per_group.get(group, {})
        step = moments.get("step")
        for name, address in mapping.items():
            def piece(flat):
                return None if flat is None else flat.narrow(0, address.start, address.numel)
            fragments[name] = {"fp32": piece(masters[group]), "exp_avg": piece(moments.get("exp_avg")),
                               "exp_avg_sq": piece(moments.get("exp_avg_sq"))}
            steps[name] = None if step is None else float(step)
    scaler = saved.get("loss_scaler")
    return PartitionFragments(fragments, steps, None if scaler is None else dict(vars(scaler)))


def engine_parameters(module: PipelineModule) -> Dict[Tuple[object, str], torch.nn.Parameter]:
    """Every parameter of this rank's stage by (spec index or tied key, name inside the layer)."""
    return {pipeline_parameter_owner(name): p for name, p in module.named_parameters()}


def _low_precision_groups(optimizer):
    return getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)


def own_loader_reads(optimizer_name: str, zero_stage: int) -> bool:
    """Whether DeepSpeed's load_checkpoint reads back the optimizer state it saved for this optimizer
    (deepspeed_config.deepspeed_optimizer's name). Why not always: at ZeRO 0, DeepSpeed 0.19's engine hands
    BF16_Optimizer.load_state_dict the one state dict of the model-states file, which indexes it as a list by
    DP rank (`state_dict_list[dp_rank]`): KeyError 0, so a bf16 ZeRO 0 run could not resume at its own layout.
    Such a checkpoint goes through the layout-free path, which reads the partition files DeepSpeed also wrote
    (training/checkpointing.py)."""
    return not (optimizer_name == "BF16_Optimizer" and zero_stage == 0)


@dataclass
class FlatPartition:
    """One optimizer group as ZeRO 1/2 or DeepSpeed's bf16 optimizer hands it to our torch optimizer: a flat
    fp32 buffer holding this DP rank's fragments of the group's parameters, cut over `group`."""
    params: List[torch.nn.Parameter]
    """Every parameter of the group (this TP rank's shard, whole), in order: the other DP ranks hold the rest."""
    fragments: Dict[int, Tuple[int, int, int]]
    """id(parameter) -> (start in the parameter's flattened values, count, start in the flat buffer), for each
    parameter with a fragment in this rank's buffer."""
    group: object
    """The process group the partition is cut over (DP, or expert-DP for an expert group)."""


def optimizer_partitions(optimizer) -> Dict[int, FlatPartition]:
    """Group index -> its FlatPartition, when DeepSpeed partitions the groups (ZeRO 1/2, the bf16 optimizer);
    {} when our optimizer holds the parameters themselves. Why: Muon orthogonalises whole matrices
    (training/muon.py), and these flat buffers cut matrices anywhere; each low-precision parameter's
    `_hp_mapping` (set by DeepSpeed's link_hp_params) says which part of it lies where in this rank's buffer,
    and `real_dp_process_group[g]` over which ranks the rest lies. Mind that ZeRO 1/2 step our optimizer one
    group at a time, showing it that group alone as `param_groups` (`_optimizer_step(group_no)`): inside a
    step, a group's index is not its place here; its flat buffer is."""
    lp_groups = _low_precision_groups(optimizer)
    if lp_groups is None:
        return {}
    partitions = {}
    for index, lps in enumerate(lp_groups):
        fragments = {}
        for lp in lps:
            mapping = lp._hp_mapping
            if mapping is not None:  # None: no fragment of this parameter in this DP rank's partition
                src, dst = mapping.lp_fragment_address, mapping.hp_fragment_address
                fragments[id(lp)] = (src.start, src.numel, dst.start)
        partitions[index] = FlatPartition(list(lps), fragments, optimizer.real_dp_process_group[index])
    return partitions


def set_master_weights(engine, values: Dict[torch.nn.Parameter, Dict[str, Optional[torch.Tensor]]]) -> None:
    """Give every parameter its fp32 weight (`values[param]["fp32"]`, this rank's TP slice, whole), and the
    fp32 master's fragment where ZeRO 1/2 or the bf16 optimizer keep one; the optimizer's state is left as
    it is (fresh, for --finetune). Why here: the masters are reached through DeepSpeed's `_hp_mapping`."""
    lp_groups = _low_precision_groups(engine.optimizer)
    with torch.no_grad():
        for param, value in values.items():
            param.data.copy_(value["fp32"].to(param.dtype))
        for lps in lp_groups or ():
            for lp in lps:
                mapping = lp._hp_mapping
                if mapping is not None:  # None: no fragment of this parameter in this DP rank's partition
                    src = mapping.lp_fragment_address
                    mapping.hp_fragment.data.copy_(values[lp]["fp32"].flatten().narrow(0, src.start, src.numel))


def set_optimizer_state(engine, values: Dict[torch.nn.Parameter, Dict[str, Optional[torch.Tensor]]],
                        step: float) -> None:
    """Give every parameter of the engine its fp32 master weight and Adam moments (this rank's TP slice,
    whole: DeepSpeed's own mapping cuts the ZeRO partition), and the optimizer its step count.

    Why: DeepSpeed loads optimizer state only from its own files at the same DP size and ZeRO stage. ZeRO
    1/2 and the bf16 optimizer link each low-precision parameter to its fragment of the flat fp32 partition
    (`param._hp_mapping`: hp_fragment, lp/hp fragment addresses); the plain torch optimizer (fp32, ZeRO 0)
    holds the parameters themselves."""
    optimizer = engine.optimizer
    lp_groups = _low_precision_groups(optimizer)

    def step_on(device):  # torch's fused AdamW keeps its step on the parameter's device
        return torch.tensor(float(step), dtype=torch.float32, device=device)
    set_master_weights(engine, values)
    with torch.no_grad():
        if lp_groups is None:  # a torch optimizer over the parameters themselves
            inner = optimizer
            for param, value in values.items():
                if value["exp_avg"] is not None:  # Muon's matrices have no exp_avg_sq (training/muon.py)
                    inner.state[param] = {"step": step_on(param.device), **{
                        key: value[key].to(param.device, torch.float32, copy=True)
                        for key in ("exp_avg", "exp_avg_sq") if value.get(key) is not None}}
            return
        inner = optimizer.optimizer
        for index, partition in optimizer_partitions(optimizer).items():
            group = inner.param_groups[index]
            flat = group["params"][0]
            # Muon's group keeps one buffer, named as AdamW's first moment (training/muon.py).
            kept = ("exp_avg",) if group.get("muon") else ("exp_avg", "exp_avg_sq")
            moments = {key: torch.zeros_like(flat) for key in kept}
            for lp in partition.params:
                fragment = partition.fragments.get(id(lp))
                if fragment is None:  # no fragment of this parameter in this DP rank's partition
                    continue
                start, count, at = fragment
                for key, buffer in moments.items():
                    if values[lp][key] is not None:
                        buffer.narrow(0, at, count).copy_(values[lp][key].flatten().narrow(0, start, count))
            inner.state[flat] = {"step": step_on(flat.device), **moments}
            for lp in partition.params:
                if id(lp) in partition.fragments:
                    lp._hp_mapping.set_optim_state_fragment(flat, inner.state[flat])


def loss_scaler_state(optimizer) -> Optional[Dict[str, object]]:
    """The fp16 loss scaler's state (current scale, iterations since an overflow, hysteresis), or None."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return None if scaler is None else dict(vars(scaler))


def set_loss_scaler_state(optimizer, saved: Optional[Dict[str, object]]) -> None:
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None or not saved:
        return
    for key, value in saved.items():
        if key in vars(scaler) and key != "dtype":
            setattr(scaler, key, value)


def set_step_counters(engine, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """The engine's step counters, as its own load_checkpoint sets them."""
    engine.global_steps = global_steps
    engine.global_samples = global_samples
    engine.skipped_steps = skipped_steps


@contextlib.contextmanager
def quiet_prints(log_level: str) -> Iterator[None]:
    """Hide what DeepSpeed print()s inside the block (STARTUP_PRINTS: the shared-memory op's
    "built successfully" on every rank, SEED_LAYERS and the topology dict on rank 0) unless
    `log_level` is info or debug.

    Why: these are print() calls, so DeepSpeed's log level does not reach them. Only this
    process's sys.stdout is swapped, for the block: DeepSpeed's logger keeps the stream it was
    created with, so its warnings and errors still show; exceptions pass through."""
    if log_level in VERBOSE_LEVELS:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def set_log_level(log_level: str) -> None:
    """DeepSpeed's logger (and its handler, which has a level of its own) at `log_level`."""
    from deepspeed.utils.logging import logger, set_log_level_from_string

    set_log_level_from_string(log_level, custom_logger=logger)


def new_groups_time_out_after(timeout: datetime.timedelta) -> None:
    """Every process group DeepSpeed creates from here on (the pipeline grid's, ZeRO's) gives up on a
    collective after `timeout`, as the world group does.

    Why: DeepSpeed's comm backend calls torch.distributed.new_group(ranks) with no timeout, and torch 2.13
    then gives the group its backend's default (30 minutes for gloo; `_new_group_with_tag`), not the world
    group's: a pipeline send to a dead rank would wait 30 minutes whatever --distributed-timeout-minutes
    says. DeepSpeed's own groups are made through its backend object (`deepspeed.comm.new_group` ->
    `cdb.new_group`); this sets that object's new_group."""
    from deepspeed.comm import comm

    def new_group(ranks):
        return torch.distributed.new_group(ranks, timeout=timeout)

    comm.cdb.new_group = new_group


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


# Sequence parallelism and the last pipeline stage's outputs (issue 23). Both wrap one instruction of this
# engine's instance-level `_INSTRUCTION_MAP` (as time_pipeline_instructions does, and composing with it).

def _wrap_instruction(engine, instruction: str, wrap: Callable[[Callable], Callable]) -> None:
    from deepspeed.runtime.pipe import schedule

    cls = getattr(schedule, instruction)
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, cls: wrap(engine._INSTRUCTION_MAP[cls])}


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

    _wrap_instruction(engine, "ReduceTiedGrads", wrap)


def accumulated_gradient(engine, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The tensor holding param's gradient summed over the step's micro-batches, at the point
    before_gradient_reduction runs, or None when it has none.

    Why: under the bf16 optimizer the sum accumulates in an fp32 buffer the engine links as
    `param._hp_grad` (DeepSpeed's own tied-weight reduction reads it there); ZeRO 1 with a
    gradient-accumulation dtype other than the weights' keeps it in `param.grad_accum`; otherwise
    `param.grad`."""
    if engine.using_bf16_optimizer:
        return getattr(param, "_hp_grad", None)
    if getattr(engine.optimizer, "use_grad_accum_attribute", False):
        return getattr(param, "grad_accum", None)
    return param.grad


def free_last_stage_outputs_after_backward(engine) -> None:
    """Drop the last stage's forward outputs (the [b, s, V/tp] logits) once their backward has run.

    Why: DeepSpeed 0.19's `_exec_backward_pass` returns early on the last stage, before the lines that
    clear `pipe_buffers['outputs']` on the other stages, so the logits of up to num_pipe_buffers (2)
    micro-batches stay alive through the next forward and the optimizer step. Nothing reads them after
    their backward: on the last stage the outputs are not sent, and eval_batch keeps what it returns
    in `engine.outputs`, not in the pipe buffer."""
    def wrap(backward):
        def backward_then_free(self, buffer_id):
            result = backward(self, buffer_id=buffer_id)
            if self.is_last_stage():
                self.pipe_buffers["outputs"][buffer_id] = None
            return result
        return backward_then_free

    _wrap_instruction(engine, "BackwardPass", wrap)


# Mixture of Experts (issue 45). DeepSpeed reduces a parameter marked `allreduce = False` with a `group_name` over
# that name's expert-data-parallel group, dividing by the whole data-parallel size (engine._reduce_expert_gradients,
# the fix of DeepSpeed #6545): the dense model's gradient, as each expert's rank already summed its EP group's
# tokens. Its ZeRO 1 and bf16 optimizers partition such parameters over that group when built for an engine that
# has MoE layers, and count each expert once in the gradient norm. We use that machinery, with our groups
# (parallel/state.py) registered under one name, rather than a reduction of our own: it is the path DeepSpeed's
# optimizers, partitions and norms were written for.

EXPERT_GROUP_NAME = "megatron_lite_experts"


def register_expert_groups(expert_group, expert_ranks, expert_data_group, expert_data_ranks) -> None:
    """Give DeepSpeed our expert-parallel and expert-data-parallel groups under EXPERT_GROUP_NAME.

    Why: DeepSpeed builds its own (groups._create_expert_and_data_parallel) from its mpu's data-parallel group,
    which under the pipeline engine is DP x CP in DeepSpeed's order but takes EP out of it its own way; ours
    (EP consecutive DP x CP places, CP first) must be the ones both the dispatch and the reduction use."""
    from deepspeed.utils import groups

    groups._EXPERT_PARALLEL_GROUP[EXPERT_GROUP_NAME] = expert_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[EXPERT_GROUP_NAME] = list(expert_ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[EXPERT_GROUP_NAME] = expert_data_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[EXPERT_GROUP_NAME] = list(expert_data_ranks)


def mark_expert_parameters(parameters) -> int:
    """Mark parameters tagged `expert_parallel` (parallel/experts.py mark_expert_parameter) as DeepSpeed's MoE parameters; how many."""
    from deepspeed.moe.utils import is_moe_param

    marked = 0
    for param in parameters:
        if getattr(param, "expert_parallel", False):
            param.allreduce = False
            param.group_name = EXPERT_GROUP_NAME
            marked += is_moe_param(param)
    return marked


def expert_optimizer_groups(param_groups: List[dict]) -> List[dict]:
    """Our parameter groups (each with a 'name') with the expert parameters moved into groups of their own
    ('moe': True), which DeepSpeed's ZeRO 1 and bf16 optimizers partition over expert-DP."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    # Never split a group by size (DeepSpeed's default cuts expert groups above 178,956,971 values): the count of
    # groups would then depend on TP and EP, and a resumed LR schedule's per-group state with it.
    return [g for g in split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=float("inf"))
            if g["params"]]


@contextlib.contextmanager
def engine_finds_experts(layer_class: type) -> Iterator[None]:
    """Inside the block, deepspeed.initialize counts `layer_class` modules as DeepSpeed MoE layers.

    Why: the engine decides `has_moe_layers` (and so builds its optimizer with expert groups and broadcasts
    expert weights within expert-DP) by isinstance against deepspeed.moe.layer.MoE, looked up in its module;
    our layer is not one. It reads only `num_experts` from such a module."""
    import deepspeed.runtime.engine as engine_module

    real = engine_module.MoE

    class _Finds(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, (real, layer_class))

    engine_module.MoE = _Finds("MoE", (), {})
    try:
        yield
    finally:
        engine_module.MoE = real


def experts_only_in_gradient_reduction(engine) -> None:
    """After initialize: the engine says it has MoE layers only while it reduces gradients.

    Why: with `has_moe_layers` the engine reduces expert gradients over expert-DP (what we need) but also
    saves and loads checkpoints in its MoE format (one file per DeepSpeed expert module, which it looks up by
    class and would not find), so the flag is on exactly inside the ReduceGrads instruction."""
    engine.has_moe_layers = False

    def wrap(reduce_grads):
        def with_experts(self, **kwargs):
            self.has_moe_layers = True
            try:
                return reduce_grads(self, **kwargs)
            finally:
                self.has_moe_layers = False
        return with_experts

    _wrap_instruction(engine, "ReduceGrads", wrap)


def expert_norm_groups_on_every_stage(engine) -> None:
    """After initialize, on every pipeline stage of an MoE model (a collective): a ZeRO 1/2 optimizer whose stage
    has fewer parameter groups than another joins the model-parallel all-reduces of the groups it lacks, with
    zeros, and adds what they return to its gradient norm.

    Why: DeepSpeedZeroOptimizer.scaled_global_norm takes one norm per group, each all-reduced over the
    model-parallel group, which spans the pipeline stages; a stage with MoE layers has its expert groups besides
    (DeepSpeed's split appends them after the others), so a stage without experts skipped those all-reduces and
    the stages hung in different collectives (measured: TP 1 x PP 2, layers [0,0,1,1], --zero-stage 1). Joined
    with zeros, each lacking group's all-reduce returns the expert group's squared norm, which every stage then
    counts, as the dense model's norm does."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import combine_grad_norm_groups
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.model_parallel_group is None:
        return
    group = optimizer.model_parallel_group
    # On the accelerator, as DeepSpeed's own norm collectives (NCCL takes no CPU tensor; the CPU-offloaded
    # optimizer's device is the CPU).
    device = get_accelerator().current_device_name()
    counts = torch.tensor([len(optimizer.bit16_groups)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
    lacking = int(counts.item()) - len(optimizer.bit16_groups)
    if lacking <= 0:
        return
    own = optimizer.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        norms = [own(norm_type)]
        for _ in range(lacking):
            squared = torch.zeros((), dtype=torch.float32, device=device)
            torch.distributed.all_reduce(squared, op=torch.distributed.ReduceOp.SUM, group=group)
            norms.append(squared.sqrt().to(norms[0].device))
        return combine_grad_norm_groups(norms, norm_type=norm_type)

    optimizer.scaled_global_norm = scaled_global_norm
