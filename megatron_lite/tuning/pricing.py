"""What a validated candidate costs: its predicted step (tuning/throughput.py, from the profile's measured
times of this model where it has them), and the key of the plan's default order (Shaden's)."""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import List, Optional, Sequence

from megatron_lite.config import Config
from megatron_lite.cost import model_state
from megatron_lite.cost.activations import context_parallel_all_to_all_bytes
from megatron_lite.cost.arithmetic import (embedding_parameters, layer_parameters, mlp_forward_flops,
                                           recompute_forward_flops_per_token)
from megatron_lite.cost.moe_activations import routed_copies
from megatron_lite.cost.muon import MuonWork, stage_work
from megatron_lite.cost.pipeline_efficiency import predicted_pipeline_efficiency
from megatron_lite.cost.stages import (per_rank, stage_bounds, stage_expert_parameters, stage_flops,
                                       stage_layer_numbers, stage_matrices, stage_mtp_layer_numbers)
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer
from megatron_lite.model.recompute_options import recompute_chunks
from megatron_lite.tuning.calibration import Profile
from megatron_lite.tuning.candidates import Candidate
from megatron_lite.tuning.throughput import (Experts, Hardware, pipeline_periods, predict_from_model_times,
                                             predict_step_seconds)


def _predict(c: Candidate, config: Config, hw: Hardware, profile: Optional[Profile] = None) -> None:
    m = config.model
    bounds = stage_bounds(config, estimate=True)
    numbers, depths = stage_layer_numbers(config, bounds), stage_mtp_layer_numbers(config, bounds)
    # A Multi-Token Prediction depth's decoder layer communicates (TP, CP) and runs as any layer of its stage.
    flops = stage_flops(config, bounds)
    layers = [len(n) + len(d) for n, d in zip(numbers, depths)]
    params = [st["parameters"] for st in c.stage_memory]
    # Time, not the logged count: the rerun priced over every key, as the fused path runs it.
    again = [recompute_forward_flops_per_token(m, [len(n)], first_layer=n.start, depths=len(d), causal=False)
             for n, d in zip(numbers, depths)]
    redone = [len(_recomputed_layer_numbers(m, n)) for n in numbers]
    bytes_per_value = 2 if config.precision.dtype_name != "fp32" else 4
    experts = expert_costs(config, bounds, bytes_per_value)
    muon = muon_costs(config, bounds)
    schedule = config.parallel.pipeline_schedule
    stage_costs = list(flops)
    if schedule == "dualpipev":  # priced per pipeline rank, each holding two of the 2 PP stages
        flops, layers, again, redone = (per_rank(config, x) for x in (flops, layers, again, redone))
        if experts is not None:
            experts = dataclasses.replace(
                experts, stage_moe_layers=per_rank(config, experts.stage_moe_layers),
                stage_recomputed_moe_layers=per_rank(config, experts.stage_recomputed_moe_layers),
                stage_parameters=per_rank(config, experts.stage_parameters))
    generic = predict_step_seconds(flops, layers, params, hw, hidden=m.hidden_size, seq=m.seq_length,
                                   tp=c.tensor_model_parallel_size, pp=c.pipeline_model_parallel_size,
                                   dp=c.data_parallel_size, micro=c.micro_batch_size,
                                   gas=c.gradient_accumulation_steps, zero_stage=c.zero_stage,
                                   recompute_flops=again, cpu_offload=c.cpu_offload,
                                   sequence_parallel=c.sequence_parallel, cp=c.context_parallel_size,
                                   cp_all_to_all_bytes=context_parallel_all_to_all_bytes(config),
                                   recomputed_layers=redone, profile=profile, bytes_per_value=bytes_per_value,
                                   experts=experts, muon=muon, muon_precision=config.optimizer.muon_fp32_matmul_prec,
                                   schedule=schedule)
    times = _predict_from_model_times(c, config, profile, layers, params, redone, bytes_per_value, muon)
    if times is not None:
        c.predicted_from = "model times"
        # Kept beside the measured price: the plan scales the generic prices of unmeasured layouts by how far
        # the generic terms missed the measured ones (generic_scale).
        times = dict(times, generic_step_seconds=generic["step_seconds"])
    else:
        c.predicted_from = "profile" if profile is not None else "constants"
        times = generic
    c.predicted_ep_comm_seconds = times.get("ep_comm_seconds", 0.0) * pipeline_periods(
        schedule, c.gradient_accumulation_steps, c.pipeline_model_parallel_size)
    c.predicted_pipeline_efficiency = predicted_pipeline_efficiency(stage_costs, c.gradient_accumulation_steps,
                                                                    schedule)
    c.predicted_parts = dict(times)
    c.predicted_step_seconds = times["step_seconds"]
    c.predicted_tokens_per_s = config.batch.global_batch_size * m.seq_length / times["step_seconds"]


def muon_costs(config: Config, bounds: Sequence[int]) -> Optional[List[MuonWork]]:
    """Each pipeline rank's Muon step (cost/muon.py) under --optimizer muon (its two stages' matrices under
    dualpipev); None under adam."""
    if config.optimizer.optimizer != "muon":
        return None
    ranks = per_rank(config, stage_matrices(config, bounds), combine=lambda parts: [x for p in parts for x in p])
    return [stage_work(config, matrices, model_state.zero_partitions(config), model_state.expert_data_partitions(config))
            for matrices in ranks]


def _predict_from_model_times(c: Candidate, config: Config, profile: Optional[Profile], layers: Sequence[int],
                              params: Sequence[int], redone: Sequence[int], bytes_per_value: int,
                              muon: Optional[List[MuonWork]] = None):
    """The step priced by the profile's measured times of this very model (tuning/measure_model.py), where it has
    them: same shape, the plan's world size, this TP, CP, EP and micro batch, measured at PP 1 and ZeRO 0 (PP,
    ZeRO 1-3 and offload from the fits on top: throughput.predict_from_model_times). None otherwise."""
    if profile is None or not profile.models:
        return None
    from megatron_lite.tuning.measure_model import shape_key  # imports torch: planning without a profile needs none

    tp, cp, ep = c.tensor_model_parallel_size, c.context_parallel_size, c.expert_model_parallel_size
    world = tp * cp * c.pipeline_model_parallel_size * c.data_parallel_size
    times = profile.model_times(shape_key(config), world)
    point = times.point(tp, c.micro_batch_size, cp, ep) if times else None
    if point is None:
        return None
    m = config.model
    return predict_from_model_times(
        point, profile, world=world, stage_layers=layers, stage_parameters=params,
        # The calibration's model: the first n layers, at the point's TP and EP.
        calibration_parameters=lambda n: embedding_parameters(m, tp) + sum(layer_parameters(m, tp, k, ep)
                                                                           for k in range(1, n + 1)),
        tp=tp, pp=c.pipeline_model_parallel_size, dp=c.data_parallel_size, micro=c.micro_batch_size,
        gas=c.gradient_accumulation_steps, hidden=m.hidden_size, seq=m.seq_length,
        sequence_parallel=c.sequence_parallel, selective=m.recompute_granularity == "selective", recomputed_layers=redone,
        tied_embedding_parameters=0 if m.untie_embeddings_and_output_weights else m.padded_vocab_size * m.hidden_size // tp,
        bytes_per_value=bytes_per_value, zero_stage=c.zero_stage, cpu_offload=c.cpu_offload, muon=muon, cp=cp,
        schedule=config.parallel.pipeline_schedule)


def _recomputed_layer_numbers(m, numbers: range) -> List[int]:
    """The layers (numbered from 1) of a stage holding `numbers` whose forward full recompute runs again in
    backward (their all-to-alls too)."""
    if m.recompute_granularity != "full":
        return []
    return [numbers.start + i for start, end, again in recompute_chunks(m.recompute_method, m.recompute_num_layers,
                                                                        len(numbers)) if again
            for i in range(start, end)]


def expert_costs(config: Config, bounds: Sequence[int], bytes_per_value: int) -> Optional[Experts]:
    """What the routed experts of a validated MoE config cost the step (tuning/throughput.py `Experts`): per
    stage its MoE layers (a Multi-Token Prediction depth's included), those full recompute runs again and the
    experts' parameters on a rank; the bytes of one dispatch all-to-all on a rank (the routed copies it sends,
    within the capacity, of h values); an MoE layer's k expert MLPs' FLOPs per token, and the rows each local
    expert's GEMM gets. None for a dense model."""
    m, ep = config.model, config.parallel.expert_model_parallel_size
    if m.num_experts is None:
        return None
    numbers, depths = stage_layer_numbers(config, bounds), stage_mtp_layer_numbers(config, bounds)
    sent, _ = routed_copies(config)
    return Experts(
        ep=ep, stage_moe_layers=[sum(is_moe_layer(m, n) for n in (*stage, *d)) for stage, d in zip(numbers, depths)],
        stage_recomputed_moe_layers=[sum(is_moe_layer(m, n) for n in _recomputed_layer_numbers(m, stage))
                                     for stage in numbers],
        all_to_all_bytes=sent * m.hidden_size * bytes_per_value,
        stage_parameters=stage_expert_parameters(config, bounds),
        layer_flops_per_token=m.moe_router_topk * mlp_forward_flops(m, expert_ffn_hidden_size(m)),
        rows_per_expert=ep * sent / m.num_experts)


def generic_scale(candidates: Sequence[Candidate]) -> float:
    """The median over the layouts priced from model times of their measured step / their generic step (1 when
    none is). On the 2-core VM the generic terms missed DP 2 and CP 2 alike: their step 3.6-4.4x and 3.8-5.4x
    below its measurement at micro batch 1-4 (benchmarks/cp_step_breakdown.py, docs/tuning.md: no fixed cost per
    micro-batch and operator, the GEMM rate of one large matmul); the measured layouts of the same plan show
    that factor for this machine and model."""
    ratios = [c.predicted_step_seconds / c.predicted_parts["generic_step_seconds"] for c in candidates
              if c.predicted_from == "model times" and c.predicted_parts.get("generic_step_seconds")]
    return statistics.median(ratios) if ratios else 1.0


def _unmeasured(c: Candidate, measured: bool) -> bool:
    """Priced from the generic terms while other layouts of the plan are priced from measured steps."""
    return measured and c.predicted_from != "model times"


def _layout_kind(c: Candidate) -> str:
    """What a layout splits beyond data parallelism, for the plan's notes: 'TP 2 x CP 2', 'PP 2', 'DP only'."""
    parts = [f"{name} {size}" for name, size in (("TP", c.tensor_model_parallel_size), ("CP", c.context_parallel_size),
                                                 ("PP", c.pipeline_model_parallel_size),
                                                 ("EP", c.expert_model_parallel_size)) if size > 1]
    return " x ".join(parts) or "DP only"


def _shaden_key(c: Candidate, gpus_per_node: int):
    # Pipeline stages are added only where the cheap savers do not make fewer stages fit. EP is 1 for a dense
    # model: TP x EP is TP, and the EP entry ties.
    return (c.gradient_accumulation_steps < 8 * c.pipeline_model_parallel_size,
            abs(math.log2(c.tensor_model_parallel_size * c.expert_model_parallel_size / gpus_per_node)),
            c.saver_tier, c.context_parallel_size, c.pipeline_model_parallel_size, -c.expert_model_parallel_size,
            c.micro_batch_size, c.saver_order, -c.predicted_tokens_per_s)
