"""Mixture-of-Experts flags against each other and the layout, before any process group: the expert count
splits over expert parallelism, which splits DP x CP; routing asks for no more experts or groups than exist."""
from __future__ import annotations

from typing import List

from megatron_lite import batching
from megatron_lite.config import Config, ConfigError, parse_moe_layer_freq


def check_moe(config: Config, notes: List[str]) -> None:
    m, p = config.model, config.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if m.num_experts is None:  # the MoE flags given without it: validation/dependent_flags.py
        return
    experts, k = m.num_experts, m.moe_router_topk
    _, pattern = parse_moe_layer_freq(m.moe_layer_freq)
    if pattern is not None and len(pattern) != m.num_layers:
        raise ConfigError(f"--moe-layer-freq {m.moe_layer_freq} has {len(pattern)} entries for --num-layers "
                          f"{m.num_layers}; give one 0 or 1 per layer, e.g. ([0]*1+[1]*{m.num_layers - 1})",
                          code="moe_layer_pattern_length")
    if pattern is not None and not any(pattern):
        raise ConfigError(f"--moe-layer-freq {m.moe_layer_freq} makes no layer MoE: --num-experts {m.num_experts} "
                          f"would build no expert. For a dense model drop --num-experts (and the --moe-* flags); "
                          f"for MoE layers put a 1 in the pattern, e.g. ([0]*{m.num_layers - 1}+[1]*1)",
                          code="moe_layer_pattern_without_moe")
    if k > experts:
        raise ConfigError(f"--moe-router-topk {k} is more than --num-experts {experts}; use --moe-router-topk "
                          f"{min(2, experts)} or more experts", code="topk_above_experts")
    dp_cp = p.data_parallel_size * p.context_parallel_size
    if dp_cp % ep:
        fits = [e for e in range(1, dp_cp + 1) if dp_cp % e == 0 and experts % e == 0]
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide data-parallel {p.data_parallel_size} x "
                          f"context-parallel {p.context_parallel_size} = {dp_cp}: expert-parallel ranks are taken "
                          f"out of those. Use --expert-model-parallel-size {batching.or_join(fits[-2:])}",
                          code="ep_not_dividing_dp_cp")
    if experts % ep:
        raise ConfigError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}: each "
                          f"expert-parallel rank holds the same number of whole experts. Use --num-experts "
                          f"{batching.or_join(batching.nearest_multiples(experts, ep))}",
                          code="experts_not_divisible_by_ep")
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if width % tp:
        raise ConfigError(f"--moe-ffn-hidden-size {width} is not divisible by --tensor-model-parallel-size {tp}: "
                          f"each expert is split column-wise over TP like the dense MLP. Use --moe-ffn-hidden-size "
                          f"{batching.or_join(batching.nearest_multiples(width, tp))}", code="moe_ffn_not_divisible")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; use "
                          f"{batching.or_join(batching.nearest_multiples(shared, tp))}", code="moe_ffn_not_divisible")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing: "
                          "DeepSeek-V3 uses 8 and 4); give both or neither", code="router_groups")
    if groups is not None:
        if experts % groups:
            raise ConfigError(f"--moe-router-num-groups {groups} does not divide --num-experts {experts}; use "
                              f"{batching.or_join([g for g in range(1, experts + 1) if experts % g == 0][-3:-1])}",
                              code="router_groups")
        if group_topk > groups:
            raise ConfigError(f"--moe-router-group-topk {group_topk} is more than --moe-router-num-groups {groups}; "
                              f"use {groups} or fewer", code="router_groups")
        if k > group_topk * (experts // groups):
            raise ConfigError(f"--moe-router-topk {k} is more than the {group_topk} x {experts // groups} experts "
                              f"of the kept groups; raise --moe-router-group-topk", code="router_groups")
        if experts // groups < 2:
            raise ConfigError(f"--moe-router-num-groups {groups} leaves one expert per group; a group is scored by "
                              f"its two best experts, so use at most {experts // 2} groups", code="router_groups")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax orders softmax and top-k; it needs "
                          "--moe-router-score-function softmax", code="router_pre_softmax")
    if m.moe_router_load_balancing_type == "seq_aux_loss" and m.moe_aux_loss_coeff == 0:
        notes.append(f"note: --moe-router-load-balancing-type {m.moe_router_load_balancing_type} with "
                     f"--moe-aux-loss-coeff 0 adds no loss")
    if ep > 1 and p.zero_stage == 0 and config.precision.dtype_name == "fp32" and config.training.save:
        raise ConfigError(f"--save with --expert-model-parallel-size {ep} at --zero-stage 0 in fp32: the checkpoint's "
                          f"Adam moments are written by data-parallel rank 0 alone, which holds 1/{ep} of the "
                          f"experts; use --zero-stage 1 (each rank writes its own experts' optimizer partition)",
                          code="ep_save_zero0")
    if p.zero_stage >= 2:
        raise ConfigError(f"--num-experts with --zero-stage {p.zero_stage}: MoE layers train under the pipeline "
                          f"engine (ZeRO 0 or 1), whose step reduces expert gradients over their own group and "
                          f"updates the expert bias; use --zero-stage 1", code="moe_with_zero")


def moe_pipeline_rules(config: Config, notes: List[str]) -> Config:
    """Every pipeline stage holds an MoE layer under DeepSpeed's bf16 optimizer at ZeRO 0: it reduces the norm of
    the expert gradients (get_norm_with_moe_layers) only on a stage whose optimizer has expert groups, over groups
    that span the stages. Measured (tests/test_moe_validation.py): TP 1 x PP 2 with layers [0,0,1,1] in bf16 at
    ZeRO 0 hung. ZeRO 1 hung the same way (one model-parallel all-reduce per optimizer group) until
    deepspeed_compat.experts.expert_norm_groups_on_every_stage; fp32 at ZeRO 0 takes our own norm."""
    m, p = config.model, config.parallel
    pp = p.pipeline_model_parallel_size
    per_group_norm = p.zero_stage == 0 and (config.precision.bf16 or config.precision.fp16)
    if (m.num_experts is None or pp == 1 or not per_group_norm or m.padded_vocab_size is None
            or p.pipeline_partition_method == "profile"):  # a profile split is known only once running
        return config
    from megatron_lite.cost.stages import rank_specs, stage_bounds
    from megatron_lite.model.moe_options import is_moe_layer

    # Per pipeline rank: its stage, or its two stages under --pipeline-schedule dualpipev.
    without = [stage for stage, specs in enumerate(rank_specs(config, stage_bounds(config)))
               if not any(1 <= spec <= m.num_layers and is_moe_layer(m, spec) for spec in specs)]
    if without:
        optimizer = "--bf16" if config.precision.bf16 else "--fp16"
        raise ConfigError(f"pipeline stage{'s' * (len(without) > 1)} {', '.join(map(str, without))} of "
                          f"--pipeline-model-parallel-size {pp} hold{'s' * (len(without) == 1)} no MoE layer "
                          f"(--moe-layer-freq {m.moe_layer_freq}, --pipeline-partition-method "
                          f"{p.pipeline_partition_method}); with {optimizer} at --zero-stage 0 DeepSpeed's optimizer reduces "
                          f"the experts' gradient norm only where it has expert groups, over all stages, so the stages "
                          f"would wait in different collectives. Use --zero-stage 1, or a --pipeline-partition-method "
                          f"(layer counts) that gives every stage an MoE layer",
                          code="moe_stage_without_experts")
    return config
