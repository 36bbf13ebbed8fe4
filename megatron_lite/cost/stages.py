"""The pipeline split's costs: each spec's FLOPs and parameters, the stage bounds a config gets, and what
each stage then holds and computes (parameters, experts, Muon's matrices, FLOPs).

The one place stage bounds are decided; the pipeline module a run trains (training/model_setup.py),
checkpoint/layout.py (which stage holds which layer file), the memory estimate and the planner all ask here.
The partitioning itself (how costs become bounds, `type:<regex>`, explicit counts): model/partition.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

from megatron_lite.config import Config, ModelConfig, require_vocab
from megatron_lite.cost.arithmetic import (
    embedding_specs,
    expert_tensors,
    head_forward_flops,
    layer_forward_flops,
    mtp_forward_flops,
    norm_parameters,
    spec_parameters,
    spec_tensors,
)
from megatron_lite.cost.matrices import HiddenMatrix, layer_matrices, mtp_matrices
from megatron_lite.cost.pipeline_efficiency import dualpipev_bubble_efficiency, predicted_pipeline_efficiency, rank_costs
from megatron_lite.model.moe_options import is_moe_layer
from megatron_lite.model.partition import PipelineSplit, SpecCost, partition
from megatron_lite.model.virtual_stages import rank_ranges, rank_stages, stage_count


def stage_matrices(config: Config, bounds: Sequence[int]) -> List[List[HiddenMatrix]]:
    """The weights --optimizer muon steps on each stage (`layer_matrices` of its layers, in order; on the stage
    holding Multi-Token Prediction's depths, theirs after them: `mtp_matrices`)."""
    m, ep = config.model, config.parallel.expert_model_parallel_size
    return [[x for n in numbers for x in layer_matrices(m, n, ep)] + (mtp_matrices(m, ep) if depths else [])
            for numbers, depths in zip(stage_layer_numbers(config, bounds), stage_mtp_layer_numbers(config, bounds))]


def spec_costs(config: Config, seconds: Optional[Sequence[float]] = None) -> List[SpecCost]:
    """Forward FLOPs per token and (whole-model: TP = EP = 1) parameters of each spec; with `seconds` (measured
    by `--pipeline-partition-method profile`) each cost also carries its time."""
    m = require_vocab(config)
    h, v = m.hidden_size, m.padded_vocab_size
    per_spec = spec_parameters(config, tp=1, ep=1)
    costs = [SpecCost("EmbeddingPipe", 4.0 * h, per_spec[0], False)]
    # An MoE layer costs its active experts' FLOPs and holds all its experts' parameters.
    costs += [SpecCost("TransformerLayerPipe", float(layer_forward_flops(m, causal=True, layer_number=i)),
                       per_spec[i], True) for i in range(1, m.num_layers + 1)]
    # Class names as model/gpt.py builds them (`type:<regex>` partitioning matches them).
    rms = m.normalization == "RMSNorm"
    norm = 4.0 * h if rms else 5.0 * h
    costs.append(SpecCost("FinalRMSNormPipe" if rms else "FinalLayerNormPipe", norm, norm_parameters(m), False))
    depths = m.mtp_num_layers or 0
    if depths:  # Multi-Token Prediction: the tokens ahead embedded (tied), then the depths with their three norms
        costs += [SpecCost("EmbeddingPipe", 4.0 * h * depths, 0, False),
                  SpecCost("MultiTokenPredictionPipe", mtp_forward_flops(m, causal=True) + 3 * depths * norm,
                           per_spec[m.num_layers + 3], False)]
    untied = m.untie_embeddings_and_output_weights
    # Head matmul plus the softmax cross entropy over the vocabulary, for the main model and each depth; a tied
    # head adds no parameters.
    costs.append(SpecCost("LMHeadPipe" if untied else "EmbeddingPipe",
                          (1 + depths) * (head_forward_flops(m) + 5.0 * v), per_spec[-1] if untied else 0, False))
    if seconds is not None:
        costs = [dataclasses.replace(c, seconds=float(t)) for c, t in zip(costs, seconds)]
    return costs


def stage_bounds(config: Config, seconds: Optional[Sequence[float]] = None, estimate: bool = False) -> List[int]:
    """Spec boundaries of the pipeline stages: stage i holds specs[bounds[i]:bounds[i + 1]]; PP stages, or 2 PP
    under --pipeline-schedule dualpipev (model/virtual_stages.py says which rank holds which).

    `profile` splits on measured `seconds`, known only once running; with `estimate=True`
    (memory estimates, the planner) the FLOP cost stands in for them."""
    p = config.parallel
    method = p.pipeline_partition_method
    if method == "profile" and seconds is None:
        if not estimate:
            raise ValueError("--pipeline-partition-method profile needs the measured seconds of every spec")
        method = "cost"
    require_vocab(config)
    return list(_bounds(config.model, stage_count(p.pipeline_model_parallel_size, p.pipeline_schedule), method,
                        None if seconds is None else tuple(seconds)))


@functools.lru_cache(maxsize=256)
def _bounds(model: ModelConfig, pp: int, method: str, seconds: Optional[Tuple[float, ...]]) -> Tuple[int, ...]:
    # The partitioner's exact search is the slow part of a plan; the model config is immutable.
    return tuple(partition(spec_costs(Config(model=model), seconds), pp, method))


def stage_module_tensors(config: Config, bounds: Sequence[int]) -> List[List[List[int]]]:
    """Each stage's modules' parameter tensors on one rank (`spec_tensors`, spec by spec), the embedding module
    once however many of its tied specs the stage holds (arithmetic.embedding_specs: with the tied head, and
    Multi-Token Prediction's on the last stage)."""
    return [_module_tensors(config, range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _module_tensors(config: Config, specs: Sequence[int]) -> List[List[int]]:
    tensors, tied = spec_tensors(config), embedding_specs(config.model)
    again = [i for i in tied if i in specs][1:]
    return [tensors[i] for i in specs if i not in again]


def rank_specs(config: Config, bounds: Sequence[int]) -> List[List[int]]:
    """The specs each pipeline rank holds: its stage's, or under --pipeline-schedule dualpipev its two stages'
    (model/virtual_stages.py)."""
    p = config.parallel
    pp, schedule = p.pipeline_model_parallel_size, p.pipeline_schedule
    return [[i for a, b in rank_ranges(bounds, pp, schedule, r) for i in range(a, b)] for r in range(pp)]


def rank_module_tensors(config: Config, bounds: Sequence[int]) -> List[List[List[int]]]:
    """`stage_module_tensors` of each pipeline rank: under dualpipev rank 0's two stages share one embedding
    module (the first stage's, tied to the last stage's head)."""
    return [_module_tensors(config, specs) for specs in rank_specs(config, bounds)]


def stage_parameters(config: Config, bounds: Sequence[int]) -> List[int]:
    """Parameters one rank of each stage holds (after the TP split): `stage_module_tensors`, summed."""
    return [sum(map(sum, modules)) for modules in stage_module_tensors(config, bounds)]


def rank_parameters(config: Config, bounds: Sequence[int]) -> List[int]:
    """Parameters each pipeline rank holds (after the TP split): `rank_module_tensors`, summed."""
    return [sum(map(sum, modules)) for modules in rank_module_tensors(config, bounds)]


def per_rank(config: Config, per_stage: Sequence, combine=sum) -> list:
    """A per-stage list as a per-pipeline-rank one: each rank's stages (one, or two under dualpipev) combined."""
    p = config.parallel
    pp, schedule = p.pipeline_model_parallel_size, p.pipeline_schedule
    return [combine([per_stage[s] for s in rank_stages(pp, schedule, r)]) for r in range(pp)]


def transformer_layers_per_stage(config: Config, bounds: Sequence[int]) -> List[int]:
    """Transformer layers (specs 1..L) on each stage."""
    return [len(numbers) for numbers in stage_layer_numbers(config, bounds)]


def stage_layer_numbers(config: Config, bounds: Sequence[int]) -> List[range]:
    """The transformer layers on each stage, numbered from 1 (spec k is layer k)."""
    end = config.model.num_layers + 1
    return [range(min(max(a, 1), end), max(min(b, end), 1)) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_mtp_layer_numbers(config: Config, bounds: Sequence[int]) -> List[range]:
    """The Multi-Token Prediction depths' decoder layers (numbered L + 1 .. L + D) on each stage: all on the stage
    holding their spec, L + 3 (the last: every stage holds a transformer layer, and none follows); empty elsewhere
    and without --mtp-num-layers."""
    m = config.model
    spec, depths = m.num_layers + 3, range(m.num_layers + 1, m.num_layers + 1 + (m.mtp_num_layers or 0))
    return [depths if depths and a <= spec < b else range(0) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_expert_parameters(config: Config, bounds: Sequence[int]) -> List[int]:
    """The routed experts' parameters one rank of each stage holds (E/EP per MoE layer, after the TP split; the
    Multi-Token Prediction depths' too): the part of `stage_parameters` that is reduced, and that ZeRO
    partitions, over expert-DP, not DP x CP."""
    m, p = config.model, config.parallel
    if m.num_experts is None:
        return [0] * (len(bounds) - 1)
    per_layer = sum(expert_tensors(m, p.tensor_model_parallel_size, p.expert_model_parallel_size))
    return [per_layer * sum(is_moe_layer(m, n) for n in (*numbers, *depths))
            for numbers, depths in zip(stage_layer_numbers(config, bounds), stage_mtp_layer_numbers(config, bounds))]


def stage_flops(config: Config, bounds: Sequence[int]) -> List[float]:
    """Forward FLOPs per token of each stage (the cost partition's measure)."""
    costs = spec_costs(config)
    return [sum(c.flops for c in costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_costs(specs: Sequence[SpecCost], bounds: Sequence[int], measured: bool) -> List[float]:
    """Each stage's cost: summed measured seconds, or summed FLOPs per token."""
    return [sum((s.seconds if measured else s.flops) for s in specs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_table(specs: Sequence[SpecCost], bounds: Sequence[int], num_micro_batches: int,
                schedule: str = "1f1b") -> str:
    """One line per stage (layers, parameters, cost relative to the mean stage, measured ms where
    profiled) and the predicted pipeline efficiency for `num_micro_batches` per step (under dualpipev, of the
    ranks' two stages together)."""
    measured = all(s.seconds is not None for s in specs)
    costs = stage_costs(specs, bounds, measured)
    mean = sum(costs) / len(costs)
    lines = [f"{'stage':>5} {'specs':>9} {'transformer':>11} {'parameters':>12} {'rel. cost':>9}"
             + (f" {'fwd+bwd ms':>10}" if measured else "") + "  layers"]
    for stage, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = specs[a:b]
        names = ", ".join(sorted({s.name for s in part}, key=[s.name for s in part].index))
        lines.append(f"{stage:>5} {f'{a}-{b - 1}':>9} {sum(s.is_transformer for s in part):>11} "
                     f"{sum(s.parameters for s in part):>12,} {costs[stage] / mean:>9.2f}"
                     + (f" {costs[stage] * 1e3:>10.1f}" if measured else "") + f"  {names}")
    source = "measured" if measured else "FLOP"
    if schedule == "dualpipev":
        ranks = rank_costs(costs, schedule)
        lines.append(f"dualpipev: rank r holds stages r and {len(costs) - 1} - r; predicted pipeline efficiency at "
                     f"{num_micro_batches} micro-batches per step: "
                     f"{predicted_pipeline_efficiency(costs, num_micro_batches, schedule):.3f} (bubble "
                     f"{dualpipev_bubble_efficiency(len(ranks), num_micro_batches):.3f} x balance of the ranks "
                     f"{sum(ranks) / len(ranks) / max(ranks):.3f}, from {source} stage costs)")
        return "\n".join(lines)
    efficiency = predicted_pipeline_efficiency(costs, num_micro_batches)
    lines.append(f"predicted pipeline efficiency at {num_micro_batches} micro-batches per step: {efficiency:.3f} "
                 f"(bubble {num_micro_batches}/{num_micro_batches + len(costs) - 1} x balance "
                 f"{mean / max(costs):.3f}, from {source} stage costs)")
    return "\n".join(lines)



def pipeline_split(config: Config, seconds: Optional[Sequence[float]] = None) -> PipelineSplit:
    """Where the GPT's pipeline module cuts its specs, with the stage table it prints; `seconds`: each spec's
    measured time, needed by `--pipeline-partition-method profile` only (training/model_setup.py)."""
    bounds = stage_bounds(config, seconds)
    table = stage_table(spec_costs(config, seconds), bounds, config.batch.gradient_accumulation_steps,
                        config.parallel.pipeline_schedule)
    return PipelineSplit(bounds, transformer_layers_per_stage(config, bounds),
                         f"pipeline stages ({config.parallel.pipeline_partition_method}):\n{table}")
