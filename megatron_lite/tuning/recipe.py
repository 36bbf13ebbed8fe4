"""The tuning recipe: candidate TP / CP / PP / EP / micro-batch / gas layouts for a cluster and a model.

Candidates come from the cluster shape: TP divides the GPUs per node, CP
(context parallelism) is 1, 2, 4, ... up to the heads per TP rank (and
--max-context-parallel) dividing the GPUs left, PP divides the GPUs left after
TP x CP (layers need not divide: the cost partitioner balances and the
imbalance shows in the predicted efficiency), DP is the rest, EP (expert
parallelism, Mixture-of-Experts models only) each degree that divides DP x CP
and --num-experts (`expert_parallel_sizes`; 1 for a dense model), micro batch
1, 2, 4, ... and gas from the global batch. Each candidate is the user's
`Config` with its layout fields replaced, and goes through the validation
pretrain_gpt.py runs (`validate_candidate`, the one call site), so a planned
layout is never refused at launch; its command line is written from that
Config (`arguments.config_to_argv`). A refused candidate keeps the validation
error's code (`reason_code`), by which the plan groups its rejections: e.g. a TP
that heads, FFN width or key/value groups do not allow (grouped-query attention
needs the groups to divide TP or TP to divide them, and a shared group's K/V
rows to split over the ranks sharing it), or a CP that the heads per TP rank,
the groups per TP rank or the sequence do not allow. Parameters, FLOPs and
memory come from model/arithmetic.py and model/memory.py, which know GPT-2's
and the Llama block alike. Then
the memory savers are tried, fastest first (`savers`), and the first whose
predicted peak on every stage fits the GPU less the margin is kept; the plan
says which saver that was:
  tier 0, no extra compute: ZeRO 0, then 1, each alone, then with sequence
          parallelism (TP > 1; its reduce-scatter + all-gather move the bytes of
          the all-reduce they replace); then selective recompute (the attention
          core's scores again) with ZeRO 0, then 1. Context parallelism counts
          here too: it divides every activation by CP for two all-to-alls per
          layer and direction (tuning/throughput.py), so a CP > 1 layout's saver
          is named "context parallel C + ..." and ranks as tier 0 after CP 1
  tier 1, recompute whole layers: --recompute-method block with 1, 2, 4, ... layers
          per stage, then every layer (uniform 1), ZeRO 0 then 1 at each
  tier 2, ZeRO 2 / 2 + optimizer offload / 3 / 3 + parameter offload (PP = 1
          only, design notes' order), each with no recompute, selective,
          block and full recompute (no sequence parallelism: it runs under the
          pipeline engine only)

EP partitions the routed experts' weights and optimizer states (model/memory.py books E/EP experts per
rank, their states over DP x CP / EP), so it is a memory saver of its own, paid for in all-to-alls
(tuning/throughput.py `Experts`).

--optimizer muon among the model flags plans with Muon: model/memory.py books its one moment per matrix and
its step's temporaries, tuning/throughput.py its Newton-Schulz work and communication (`muon_costs`).

Order (default `shaden`): layouts with gas >= 8 x PP (bubble <= ~11%) first,
then TP x EP closest to the GPUs per node (for a dense model EP is 1: TP closest to them; for an MoE
model the EP and TP groups both belong in the NVLink domain, Megatron-LM's MoE guide), then the saver
tier (a layout that fits with sequence parallelism, selective recompute or context parallelism ranks
above one that needs whole layers recomputed, and all above ZeRO 2/3/offload:
stages are added only when the cheap savers do not fit), the smallest CP (its
all-to-alls cross nodes once TP x CP exceeds the GPUs per node), the fewest
stages, the largest EP (with TP x EP set, EP before TP: a smaller TP leaves larger GEMMs and fewer
all-reduces, and EP's all-to-alls move only the routed copies; the MoE guide measured EP 8 x TP 1 above
EP 4 x TP 2 for Mixtral 8x7B), micro batch 1 before larger ones, the saver's place in its tier, and
predicted throughput last. `throughput`
orders by the predicted tokens/s of tuning/throughput.py alone.
Samyam's micro-batch probe (`micro_batch_probe`): one node, the model cut to a
few layers at full hidden size, PP = 1, micro batch 1..64 at gas 1.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_lite.arguments import build_parser, config_to_argv, given_fields
from megatron_lite.atomic import write_text
from megatron_lite.config import Config, ConfigError, flag_for
from megatron_lite.model import memory
from megatron_lite.model.activations import context_parallel_all_to_all_bytes, routed_copies
from megatron_lite.model.arithmetic import (
    embedding_parameters,
    layer_parameters,
    mlp_forward_flops,
    recompute_chunks,
    recompute_forward_flops_per_token,
    stage_bounds,
    stage_expert_parameters,
    stage_flops,
    stage_layer_numbers,
    stage_matrices,
    transformer_layers_per_stage,
)
from megatron_lite.model.muon_cost import MuonWork, stage_work
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer, layer_freq_for
from megatron_lite.model.pipeline_efficiency import predicted_pipeline_efficiency
from megatron_lite.reading import UnreadableFile, read_json
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning.calibration import Profile
from megatron_lite.tuning.throughput import Experts, Hardware, predict_from_model_times, predict_step_seconds
from megatron_lite.validation import validate

LAYOUT_FIELDS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "micro_batch_size", "gradient_accumulation_steps", "zero_stage",
                 "cpu_offload", "sequence_parallel", "recompute_activations", "recompute_granularity",
                 "recompute_method", "recompute_num_layers")
"""Config fields each candidate sets (the user's values for them are replaced)."""
LAYOUT_FLAGS = tuple(flag_for(name) for name in LAYOUT_FIELDS)
REJECTION_LABELS = {
    "does_not_fit_memory": "does not fit in memory",
    "layers_fewer_than_stages": "layers fewer than stages",
    "heads_not_divisible_by_tp": "heads not divisible by TP",
    "ffn_not_divisible_by_tp": "FFN width not divisible by TP",
    "hidden_not_divisible_by_heads": "hidden not divisible by heads",
    "groups_not_compatible_with_tp": "query groups neither divide nor are divided by TP (or K/V rows do not split)",
    "heads_not_divisible_by_groups": "heads not divisible by query groups",
    "batch_not_divisible": "global batch not divisible by micro x DP",
    "world_not_divisible": "world size not divisible by TP x CP x PP",
    "heads_not_divisible_by_cp": "heads per TP rank not divisible by CP",
    "groups_not_compatible_with_cp": "query groups per TP rank neither divide nor are divided by CP",
    "seq_not_divisible_by_cp": "sequence not divisible by CP (x TP with sequence parallelism)",
}
"""Reason code -> the words the plan's table groups rejections under."""
ZERO_LADDER = ((0, False, False), (1, False, False), (2, False, False), (2, True, False), (3, False, False),
               (3, True, True))
"""(ZeRO stage, optimizer offload, parameter offload), fastest first."""


@dataclass(frozen=True)
class Saver:
    """A memory saver: ZeRO and offload, sequence parallelism, activation recompute."""
    zero_stage: int = 0
    cpu_offload: bool = False
    offload_param: bool = False
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None

    @property
    def tier(self) -> int:
        """0: no extra compute (selective's scores aside); 1: whole layers recomputed; 2: ZeRO 2/3 or offload."""
        if self.zero_stage >= 2 or self.cpu_offload:
            return 2
        return 1 if self.recompute_granularity == "full" else 0

    @property
    def name(self) -> str:
        parts = [f"ZeRO {self.zero_stage}"] if self.zero_stage else []
        if self.offload_param:
            parts.append("parameter + optimizer offload")
        elif self.cpu_offload:
            parts.append("optimizer offload")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.recompute_granularity == "selective":
            parts.append("selective recompute")
        elif self.recompute_method == "block":
            parts.append(f"recompute {self.recompute_num_layers} layer{'s' if self.recompute_num_layers > 1 else ''}"
                         f" per stage")
        elif self.recompute_granularity == "full":
            parts.append("full recompute")
        return " + ".join(parts) or "none"


def savers(tp: int, pp: int, seq_length: int, max_stage_layers: int, cp: int = 1) -> List[Saver]:
    """Every saver to try for a layout, fastest first (the module docstring gives the order)."""
    sp = tp > 1 and seq_length % (tp * cp) == 0
    activation = [{}] + ([{"sequence_parallel": True}] if sp else [])
    selective = {"sequence_parallel": sp, "recompute_granularity": "selective"}
    full = [{"sequence_parallel": sp, "recompute_granularity": "full", "recompute_method": "block",
             "recompute_num_layers": n} for n in (2 ** k for k in range(max_stage_layers.bit_length()))
            if n < max_stage_layers]
    full.append({"sequence_parallel": sp, "recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1})
    ladder = [Saver(zero, **a) for zero in (0, 1) for a in activation]
    ladder += [Saver(zero, **selective) for zero in (0, 1)]
    ladder += [Saver(zero, **f) for f in full for zero in (0, 1)]
    no_sp = [{}, {"recompute_granularity": "selective"}] + [dict(f, sequence_parallel=False) for f in full]
    ladder += [Saver(zero, offload, offload_param, **a) for zero, offload, offload_param in ZERO_LADDER[2:]
               if pp == 1 for a in no_sp]
    return ladder


OFFLOAD_PARAM_JSON = "zero3_offload_param.json"
OFFLOAD_PARAM = {"zero_optimization": {"offload_param": {"device": "cpu"}}}
"""What the ZeRO-3 parameter-offload candidates add to the run's DeepSpeed config, written beside the plan."""


def offload_json_problem(plan_output: str, overwrite: bool) -> Optional[str]:
    """Why plan must not write OFFLOAD_PARAM_JSON beside `plan_output`, or None: a file of that name with other
    contents is the user's (a plan's own, from an earlier run, is the same bytes and is kept)."""
    path = os.path.join(os.path.dirname(os.path.abspath(plan_output)), OFFLOAD_PARAM_JSON)
    if overwrite or not os.path.lexists(path):
        return None
    try:
        if read_json(path) == OFFLOAD_PARAM:
            return None
    except UnreadableFile:
        pass
    return (f"--output {plan_output} writes the ZeRO-3 candidates' {OFFLOAD_PARAM_JSON} beside it, and {path} "
            f"already exists with other contents; give --output in another folder, or add --overwrite to replace it")


def validate_candidate(config: Config, world_size: int) -> Config:
    """The validation pretrain_gpt.py runs; raises ConfigError with its message and code. The one call site."""
    return validate(config, world_size)[0]


@dataclass
class Candidate:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    """EP: ranks of DP x CP that split each MoE layer's experts (1 for a dense model)."""
    gradient_accumulation_steps: int = 0
    zero_stage: int = 0
    cpu_offload: bool = False
    offload_param: bool = False
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    saver: str = ""
    """The memory saver that made it fit ("none" when the fastest setting fits; "context parallel C + ..."
    at CP > 1)."""
    saver_tier: int = 0
    """0: nothing or sequence / context parallelism, selective recompute; 1: whole layers recomputed; 2: ZeRO 2/3,
    offload."""
    saver_order: int = 0
    """The saver's place in the layout's list of savers, fastest first."""
    peak_bytes_per_stage: List[int] = field(default_factory=list)
    stage_memory: List[Dict[str, Any]] = field(default_factory=list)
    predicted_pipeline_efficiency: float = 0.0
    predicted_step_seconds: float = 0.0
    predicted_tokens_per_s: float = 0.0
    predicted_ep_comm_seconds: float = 0.0
    """The expert all-to-alls' part of the predicted step: the slowest stage's per micro-batch x (g + p - 1)."""
    predicted_parts: Dict[str, float] = field(default_factory=dict)
    """The predicted step's terms in seconds (tuning/throughput.py's result: pipeline, stage, dp_comm, ...)."""
    predicted_from: str = ""
    """What priced the step: "model times" (the profile's measurements of this model), "profile" (its GEMM and
    collective fits), "constants" (no profile)."""
    predicted_relative_throughput: float = 0.0
    argv: List[str] = field(default_factory=list)
    """The pretrain_gpt.py layout flags of this candidate."""
    pretrain_argv: List[str] = field(default_factory=list)
    """All its pretrain_gpt.py flags: the model's and the batch's as planned, then the layout flags."""
    rank: int = 0
    throughput_rank: int = 0
    name: str = ""

    @property
    def layout(self) -> str:
        ep = self.expert_model_parallel_size
        return (f"tp{self.tensor_model_parallel_size}_cp{self.context_parallel_size}_"
                f"pp{self.pipeline_model_parallel_size}_dp{self.data_parallel_size}{f'_ep{ep}' if ep > 1 else ''}"
                f"_mb{self.micro_batch_size}")


def candidate_config(base: Config, c: Candidate, offload_param_json: Optional[str]) -> Config:
    """The user's (unvalidated) config with the candidate's layout."""
    extra = {"training__deepspeed_config": offload_param_json} if c.offload_param else {}
    return base.replace(
        parallel__tensor_model_parallel_size=c.tensor_model_parallel_size,
        parallel__context_parallel_size=c.context_parallel_size,
        parallel__pipeline_model_parallel_size=c.pipeline_model_parallel_size,
        parallel__expert_model_parallel_size=c.expert_model_parallel_size,
        parallel__zero_stage=c.zero_stage, parallel__cpu_offload=c.cpu_offload,
        parallel__sequence_parallel=c.sequence_parallel,
        batch__micro_batch_size=c.micro_batch_size, batch__gradient_accumulation_steps=None,
        model__recompute_activations=False, model__recompute_granularity=c.recompute_granularity,
        model__recompute_method=c.recompute_method, model__recompute_num_layers=c.recompute_num_layers, **extra)


SAVER_FLAGS = ("cpu_offload", "sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers")


def layout_argv(c: Candidate, config: Config) -> List[str]:
    """A candidate's layout flags, TP / CP / PP / micro batch / ZeRO always spelled out, EP too for an MoE model
    (and the DeepSpeed JSON that asks for ZeRO-3 parameter offload, which replaces the user's)."""
    shown = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
             "micro_batch_size", "zero_stage")
    if config.model.num_experts is not None:
        shown += ("expert_model_parallel_size",)
    return (config_to_argv(config, fields=shown, include_defaults=True)
            + config_to_argv(config, fields=SAVER_FLAGS)
            + (config_to_argv(config, fields=("deepspeed_config",)) if c.offload_param else []))


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_parallel_sizes(model: Config, data_context_ranks: int, limit: Optional[int] = None) -> List[int]:
    """EP degrees to try where DP x CP = `data_context_ranks`: those dividing it and --num-experts (each EP
    rank holds whole experts), up to `limit`; [1] for a dense model."""
    experts = model.model.num_experts
    if experts is None:
        return [1]
    return [e for e in divisors(data_context_ranks) if experts % e == 0 and (limit is None or e <= limit)]


@dataclass
class Plan:
    mode: str
    cluster: Dict[str, Any]
    model_argv: List[str]
    """The model and batch flags as the user gave them."""
    memory_budget_bytes: int
    candidates: List[Candidate]
    rejected: List[Dict[str, Any]]
    notes: List[str] = field(default_factory=list)
    """What the plan changed of the user's flags (their layout flags are replaced per candidate)."""

    def to_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "cluster": self.cluster, "model_argv": self.model_argv,
                "memory_budget_bytes": self.memory_budget_bytes,
                "candidates": [dict(asdict(c), layout=c.layout) for c in self.candidates],
                "rejected": self.rejected, "notes": self.notes}

    def save(self, path: str) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1))


def _try_savers(base: Candidate, model: Config, model_fields: Sequence[str], world: int, budget: int, device: str,
                offload_param_json: str, fitting: Optional[List[Tuple[Candidate, Config]]] = None
                ) -> Tuple[Optional[Candidate], Optional[Config], str, str]:
    """The first saver that fits, as (candidate, validated config, "", ""), or (None, None, reason, reason code).
    model_fields: the fields (not layout) whose flags the candidate's command line spells out.
    fitting: given, every saver that fits is appended to it as (candidate, config), not only the first."""
    pp, cp = base.pipeline_model_parallel_size, base.context_parallel_size
    last_error: Optional[ConfigError] = None
    smallest = None
    stage_layers = -(-model.model.num_layers // pp)  # the most a stage holds under a uniform split
    for order, saver in enumerate(savers(base.tensor_model_parallel_size, pp, model.model.seq_length,
                                         stage_layers, cp)):
        name = saver.name if cp == 1 else " + ".join(
            [f"context parallel {cp}"] + ([saver.name] if saver.name != "none" else []))
        c = Candidate(**{**asdict(base), **asdict(saver), "saver": name, "saver_tier": saver.tier,
                         "saver_order": order})
        planned = candidate_config(model, c, offload_param_json)
        try:
            config = validate_candidate(planned, world)
        except ConfigError as e:
            last_error = e
            continue
        stages = memory.estimate(config, deepspeed_config(config), device=device)
        peaks = [st.peak for st in stages]
        if smallest is None or max(peaks) < max(smallest[0]):
            smallest = (peaks, name)
        if max(peaks) <= budget:
            c.gradient_accumulation_steps = config.batch.gradient_accumulation_steps
            c.peak_bytes_per_stage = peaks
            c.stage_memory = [st.to_dict() for st in stages]
            c.argv = layout_argv(c, planned)
            shown = [f for f in model_fields if not (c.offload_param and f == "deepspeed_config")]
            c.pretrain_argv = config_to_argv(planned, fields=shown, include_defaults=True) + c.argv
            if fitting is None:
                return c, config, "", ""
            fitting.append((c, config))
    if fitting:
        return fitting[0][0], fitting[0][1], "", ""
    if smallest is None:
        return None, None, str(last_error), last_error.code
    worst = max(range(len(smallest[0])), key=lambda i: smallest[0][i])
    return None, None, (f"does not fit: even with {smallest[1]} stage {worst} needs "
                        f"{smallest[0][worst] / memory.GIB:.1f} GiB > budget {budget / memory.GIB:.1f} GiB"), \
        "does_not_fit_memory"


def _predict(c: Candidate, config: Config, hw: Hardware, profile: Optional[Profile] = None) -> None:
    m = config.model
    bounds = stage_bounds(config, estimate=True)
    flops, layers = stage_flops(config, bounds), transformer_layers_per_stage(config, bounds)
    numbers = stage_layer_numbers(config, bounds)
    params = [st["parameters"] for st in c.stage_memory]
    again = [recompute_forward_flops_per_token(m, [len(n)], first_layer=n.start) for n in numbers]
    redone = [len(_recomputed_layer_numbers(m, n)) for n in numbers]
    bytes_per_value = 2 if config.precision.dtype_name != "fp32" else 4
    experts = expert_costs(config, bounds, bytes_per_value)
    muon = muon_costs(config, bounds)
    generic = predict_step_seconds(flops, layers, params, hw, hidden=m.hidden_size, seq=m.seq_length,
                                   tp=c.tensor_model_parallel_size, pp=c.pipeline_model_parallel_size,
                                   dp=c.data_parallel_size, micro=c.micro_batch_size,
                                   gas=c.gradient_accumulation_steps, zero_stage=c.zero_stage,
                                   recompute_flops=again, cpu_offload=c.cpu_offload,
                                   sequence_parallel=c.sequence_parallel, cp=c.context_parallel_size,
                                   cp_all_to_all_bytes=context_parallel_all_to_all_bytes(config),
                                   recomputed_layers=redone, profile=profile, bytes_per_value=bytes_per_value,
                                   experts=experts, muon=muon, muon_precision=config.optimizer.muon_fp32_matmul_prec)
    times = _predict_from_model_times(c, config, profile, layers, params, redone, bytes_per_value, muon)
    if times is not None:
        c.predicted_from = "model times"
        # Kept beside the measured price: the plan scales the generic prices of unmeasured layouts by how far
        # the generic terms missed the measured ones (generic_scale).
        times = dict(times, generic_step_seconds=generic["step_seconds"])
    else:
        c.predicted_from = "profile" if profile is not None else "constants"
        times = generic
    c.predicted_ep_comm_seconds = times.get("ep_comm_seconds", 0.0) * (c.gradient_accumulation_steps
                                                                         + c.pipeline_model_parallel_size - 1)
    c.predicted_pipeline_efficiency = predicted_pipeline_efficiency(list(flops), c.gradient_accumulation_steps)
    c.predicted_parts = dict(times)
    c.predicted_step_seconds = times["step_seconds"]
    c.predicted_tokens_per_s = config.batch.global_batch_size * m.seq_length / times["step_seconds"]


def muon_costs(config: Config, bounds: Sequence[int]) -> Optional[List[MuonWork]]:
    """Each stage's Muon step on one rank (model/muon_cost.py) under --optimizer muon; None under adam."""
    if config.optimizer.optimizer != "muon":
        return None
    return [stage_work(config, matrices, memory.zero_partitions(config), memory.expert_data_partitions(config))
            for matrices in stage_matrices(config, bounds)]


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
        bytes_per_value=bytes_per_value, zero_stage=c.zero_stage, cpu_offload=c.cpu_offload, muon=muon, cp=cp)


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
    stage its MoE layers, those full recompute runs again and the experts' parameters on a rank; the bytes of
    one dispatch all-to-all on a rank (the routed copies it sends, within the capacity, of h values); an MoE
    layer's k expert MLPs' FLOPs per token, and the rows each local expert's GEMM gets. None for a dense model."""
    m, ep = config.model, config.parallel.expert_model_parallel_size
    if m.num_experts is None:
        return None
    numbers = stage_layer_numbers(config, bounds)
    sent, _ = routed_copies(config)
    return Experts(
        ep=ep, stage_moe_layers=[sum(is_moe_layer(m, n) for n in stage) for stage in numbers],
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


def plan(model_argv: Sequence[str], nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         memory_margin: float = 0.1, max_micro_batch: int = 8, order: str = "shaden",
         hardware: Optional[Hardware] = None, device: str = "cuda", workdir: str = ".",
         micro_batch_probe: bool = False, probe_layers: int = 2, progress=None,
         max_context_parallel: Optional[int] = None, profile: Optional[Profile] = None,
         all_savers: bool = False, max_expert_parallel: Optional[int] = None) -> Plan:
    """Candidates for the cluster, validated, memory-checked, predicted and ordered.

    model_argv: pretrain_gpt.py flags describing the model and the batch (argparse exits 2 on an
    unknown one); the layout flags among them are replaced per candidate, which the plan's notes say.
    max_context_parallel: the largest CP tried (default: the heads per TP rank; 1 plans without CP).
    max_expert_parallel: the largest EP tried for an MoE model (default: --num-experts; 1 plans without EP).
    profile: measured hardware (tuning/calibration.py) that prices the candidates instead of `hardware`.
    all_savers: keep every memory saver that fits a layout as a candidate of its own, not only the fastest (to
    sweep them: recompute and sequence parallelism cost time a sweep can measure)."""
    if profile is not None and profile.device != device:
        raise ConfigError(f"the profile was measured on {profile.device}, the plan is for {device}", code="bad_profile")
    hw = hardware or Hardware(gpus_per_node=gpus_per_node)
    model_argv = list(model_argv)
    given = given_fields(build_parser().parse_args(model_argv))
    model = Config().replace(**given)
    mode = "micro-batch-probe" if micro_batch_probe else "layout"
    notes = [f"your {flag_for(key.split('__')[1])} {_shown(value)} is replaced: each candidate chooses its own "
             f"({'the saver column says which' if key.split('__')[1] in _SAVER_FIELDS else 'the layout columns'})"
             for key, value in given.items() if key.split("__")[1] in LAYOUT_FIELDS]
    model_fields = [key.split("__")[1] for key in given if key.split("__")[1] not in LAYOUT_FIELDS]
    if micro_batch_probe:
        nodes = 1
        model = model.replace(model__num_layers=probe_layers,
                              model__moe_layer_freq=layer_freq_for(model.model, probe_layers))
        model_fields += ["num_layers", "global_batch_size"]
        max_micro_batch = max(max_micro_batch, 64)
    world = nodes * gpus_per_node
    budget = int(gpu_memory_gb * memory.GIB * (1.0 - memory_margin))
    os.makedirs(workdir, exist_ok=True)
    offload_param_json = os.path.join(workdir, OFFLOAD_PARAM_JSON)
    write_text(offload_param_json, json.dumps(OFFLOAD_PARAM))

    micro_sizes = [2 ** k for k in range(int(math.log2(max_micro_batch)) + 1)]
    kept, rejected = [], []
    tps = divisors(gpus_per_node)
    layouts = [(tp, cp) for tp in tps for cp in context_parallel_sizes(model, tp, world, max_context_parallel)]
    for tp, cp in layouts:
        for pp, ep in [(pp, ep) for pp in ([1] if micro_batch_probe else divisors(world // (tp * cp)))
                       for ep in expert_parallel_sizes(model, world // (tp * pp), max_expert_parallel)]:
            dp = world // (tp * cp * pp)
            for micro in micro_sizes:
                base = Candidate(tp, pp, dp, micro, context_parallel_size=cp, expert_model_parallel_size=ep)
                planned = model.replace(batch__global_batch_size=micro * dp) if micro_batch_probe else model
                fitting: Optional[List[Tuple[Candidate, Config]]] = [] if all_savers else None
                c, config, reason, code = _try_savers(base, planned, model_fields, world, budget, device,
                                                      offload_param_json, fitting)
                if c is None:
                    rejected.append({"layout": base.layout, "tensor_model_parallel_size": tp,
                                     "context_parallel_size": cp, "pipeline_model_parallel_size": pp,
                                     "data_parallel_size": dp, "expert_model_parallel_size": ep,
                                     "micro_batch_size": micro, "reason": reason, "reason_code": code})
                    continue
                for c, config in fitting or [(c, config)]:
                    _predict(c, config, hw, profile)
                    kept.append(c)
                if progress:
                    progress(len(kept), len(rejected))
    # A layout priced from calibrate's timed steps of this model outranks one priced from the generic terms
    # (the profile's GEMM and collective fits, or the constants): those terms ran 2.6-2.9x fast for context
    # parallelism on the 2-core VM (issue 48), so a generic price only ranks among its own kind, scaled by how
    # far the generic terms missed the measured layouts of this plan.
    measured = any(c.predicted_from == "model times" for c in kept)
    scale = generic_scale(kept)
    for c in kept:
        if _unmeasured(c, measured):
            c.predicted_parts["generic_scale"] = scale
            c.predicted_step_seconds *= scale
            c.predicted_tokens_per_s /= scale
    best = max((c.predicted_tokens_per_s for c in kept), default=1.0)
    for c in kept:
        c.predicted_relative_throughput = c.predicted_tokens_per_s / best
    for i, c in enumerate(sorted(kept, key=lambda c: (_unmeasured(c, measured), -c.predicted_tokens_per_s)), 1):
        c.throughput_rank = i
    generic = [c for c in kept if _unmeasured(c, measured)]
    if generic:
        kinds = sorted({_layout_kind(c) for c in generic})
        notes.append(f"{len(generic)} of {len(kept)} layouts ({', '.join(kinds)}) are priced from the profile's "
                     f"generic terms, not from calibrate's timed steps of this model: their thr.rank comes after "
                     f"the {len(kept) - len(generic)} measured ones (the 'from' column), their step is the generic "
                     f"terms' x {scale:.3g} (the median measured / generic step of the measured layouts); "
                     f"calibrate with those layouts to rank them by measurement")
    if order == "throughput" or micro_batch_probe:
        kept.sort(key=lambda c: c.throughput_rank)
    else:
        kept.sort(key=lambda c: _shaden_key(c, gpus_per_node))
    for i, c in enumerate(kept, 1):
        c.rank = i
        c.name = f"{i:03d}_{c.layout}"
        if all_savers:  # one layout, several candidates: the saver tells them apart
            c.name += "_" + "".join(ch if ch.isalnum() else "-" for ch in c.saver.lower()).replace("---", "_")
    cluster = {"nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_memory_gb": gpu_memory_gb,
               "memory_margin": memory_margin, "order": order, "all_savers": all_savers, "device": device, "hardware": asdict(hw),
               "max_context_parallel": max_context_parallel, "max_expert_parallel": max_expert_parallel,
               "num_experts": model.model.num_experts}
    if profile is not None:
        cluster["profile"] = {"device": profile.device, "device_name": profile.device_name, "backend": profile.backend,
                              "torch_version": profile.torch_version, "date": profile.date}
    return Plan(mode, cluster, model_argv, budget, kept, rejected, notes)


def context_parallel_sizes(model: Config, tp: int, world: int, limit: Optional[int] = None) -> List[int]:
    """CP degrees to try at TP tp: 1, 2, 4, ... dividing the ranks TP leaves, up to the heads per TP rank
    (each CP rank attends with whole heads) and `limit`. Validation refuses those the heads, groups or
    sequence do not divide, with its reason."""
    most = max(model.model.num_attention_heads // tp, 1)
    if limit is not None:
        most = min(most, limit)
    return [c for c in (2 ** k for k in range(most.bit_length())) if c <= most and (world // tp) % c == 0]


_SAVER_FIELDS = ("zero_stage", "cpu_offload", "sequence_parallel", "recompute_activations", "recompute_granularity",
                 "recompute_method", "recompute_num_layers")


def _shown(value) -> str:
    return "" if value is True else str(value)


def rejection_kind(rejection: Dict[str, Any]) -> str:
    """The words a rejection is grouped under in the table, from its reason code."""
    code = rejection.get("reason_code", "invalid")
    return REJECTION_LABELS.get(code, code.replace("_", " "))


def first_choice_reason(p: Plan) -> str:
    """Why the plan's first candidate is first, in the words of its order."""
    if not p.candidates:
        return "no candidate fits"
    c, gpus_per_node = p.candidates[0], p.cluster["gpus_per_node"]
    tail = (f"peak {max(c.peak_bytes_per_stage) / memory.GIB:.1f} GiB of the {p.memory_budget_bytes / memory.GIB:.1f} "
            f"GiB budget; predicted throughput rank {c.throughput_rank} of {len(p.candidates)}")
    if p.cluster["order"] == "throughput" or p.mode == "micro-batch-probe":
        return f"{c.layout}: the highest predicted tokens/s; {tail}"
    pp, gas = c.pipeline_model_parallel_size, c.gradient_accumulation_steps
    tp, cp, ep = c.tensor_model_parallel_size, c.context_parallel_size, c.expert_model_parallel_size
    moe = p.cluster.get("num_experts") is not None
    group = f"TP {tp} x EP {ep}" if moe else f"TP {tp}"
    fills = "= GPUs per node" if tp * ep == gpus_per_node else f"the nearest to {gpus_per_node} GPUs per node"
    return (f"{c.layout}: gas {gas} {'>=' if gas >= 8 * pp else '<'} 8 x PP {pp}, {group} {fills}, "
            f"memory saver '{c.saver}' (tier {c.saver_tier}), CP {cp}, {pp} stage{'s' if pp > 1 else ''}, "
            f"{f'EP {ep}, ' if moe else ''}micro batch {c.micro_batch_size} (Shaden's order, in that priority); {tail}")


PRICED_FROM = {"model times": "model", "profile": "profile", "constants": "const"}
"""The table's 'from' column: calibrate's timed steps of this model, the profile's generic fits, or the constants."""


def format_plan(p: Plan, limit: int = 30) -> str:
    # An MoE model's plan adds EP and the expert all-to-alls' share of the predicted step.
    moe = p.cluster.get("num_experts") is not None
    lines = [f"{'rank':>4} {'thr.rank':>8} {'TP':>3} {'CP':>3} {'PP':>3} {'DP':>4} " + ("  EP " if moe else "")
             + f"{'micro':>5} {'gas':>5} {'peak GiB (stages)':>24} {'pipe eff':>8} {'rel. thr':>8} "
             + ("a2a % " if moe else "") + f"{'from':>7}  saver"]
    for c in p.candidates[:limit]:
        peaks = [x / memory.GIB for x in c.peak_bytes_per_stage]
        peak_txt = (f"{max(peaks):.3g} ({peaks[0]:.3g}..{peaks[-1]:.3g})" if len(peaks) > 1
                    else f"{peaks[0]:.3g}")
        a2a = f"{100 * c.predicted_ep_comm_seconds / c.predicted_step_seconds:>5.1f} " if moe else ""
        lines.append(f"{c.rank:>4} {c.throughput_rank:>8} {c.tensor_model_parallel_size:>3} "
                     f"{c.context_parallel_size:>3} {c.pipeline_model_parallel_size:>3} "
                     f"{c.data_parallel_size:>4} " + (f"{c.expert_model_parallel_size:>4} " if moe else "")
                     + f"{c.micro_batch_size:>5} {c.gradient_accumulation_steps:>5} {peak_txt:>24} "
                     f"{c.predicted_pipeline_efficiency:>8.3f} {c.predicted_relative_throughput:>8.3f} {a2a}"
                     f"{PRICED_FROM.get(c.predicted_from, c.predicted_from):>7}  {c.saver}")
    if len(p.candidates) > limit:
        lines.append(f"... {len(p.candidates) - limit} more in the JSON")
    kinds: Dict[str, List[str]] = {}
    for r in p.rejected:
        kinds.setdefault(rejection_kind(r), []).append(r["layout"])
    lines += [f"note: {note}" for note in p.notes]
    lines.append(f"{len(p.candidates)} candidates kept, {len(p.rejected)} rejected (every reason in the JSON):")
    for kind, layouts in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(layouts[:4]) + (", ..." if len(layouts) > 4 else "")
        lines.append(f"  {len(layouts):>4} x {kind}: {shown}")
    return "\n".join(lines)
