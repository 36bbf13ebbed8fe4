"""Mixture of Experts through DeepSpeed's machinery: our expert groups registered under one name, DeepSpeed's
parameter marks and optimizer groups, and the engine's MoE flag and per-group norms."""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

from megatron_lite.deepspeed_compat.pipeline import wrap_instruction


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

    wrap_instruction(engine, "ReduceGrads", wrap)


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
