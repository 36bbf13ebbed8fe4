"""HOOKS: what each of this package's hooks relies on in the installed DeepSpeed, in one list
(`tests/test_deepspeed_compat.py` checks every entry), and `resolve`, which finds the object a path names."""
from __future__ import annotations

from typing import Sequence, Tuple


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
    # Sequence parallelism, recompute and the last stage's outputs (issue 23; pipeline.py).
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
    # --pipeline-schedule dualpipev (dualpipev.py): deepspeed.initialize builds DualPipeVEngine for a DualPipeVModule,
    # whose _partition_layers doubles the stages and calls ours; its two stages' layers and bounds; the schedules
    # instruction_streams replays.
    ("deepspeed.DualPipeVModule", "module name"),
    ("deepspeed.runtime.pipe.dualpipev.DualPipeVModule._partition_layers", "self, method"),
    ("deepspeed.runtime.pipe.dualpipev.DualPipeVModule.activate_phase", "self, phase"),
    ("deepspeed.runtime.pipe.dualpipev.DualPipeVModule.phase_bounds", "attribute"),
    ("deepspeed.runtime.pipe.dualpipev.DualPipeVModule.phase_funcs", "attribute"),
    ("deepspeed.runtime.pipe.schedule.DualPipeVSchedule.__init__", "self, micro_batches, stages, stage_id"),
    ("deepspeed.runtime.pipe.schedule.TrainSchedule.__init__", "self, micro_batches, stages, stage_id"),
    # The numerical guard (step_guard.py): each rank's loss before the reduction, a step left out as an overflow is.
    ("deepspeed.runtime.pipe.engine.PipelineEngine.total_loss", "attribute"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine._exec_optimizer_step", "self, lr_kwargs"),
    ("deepspeed.runtime.pipe.module.PipelineModule.loss_fn", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine._step_applied", "attribute"),
    ("deepspeed.runtime.engine.DeepSpeedEngine.zero_grad", "self"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.zero_grad", "self, set_to_none"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.averaged_gradients", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.cpu_offload", "attribute"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reset_cpu_buffers", "self"),
)


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
