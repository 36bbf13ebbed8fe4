"""The planner's candidates: the layouts a cluster allows, the memory savers tried on each (fastest first), and
each candidate's config and command line, validated as pretrain_gpt.py validates it (recipe.py's docstring
gives the order of both)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_lite.arguments import config_to_argv
from megatron_lite.config import Config, ConfigError, flag_for
from megatron_lite.cost import memory
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.reading import UnreadableFile, read_json
from megatron_lite.validation import validate

LAYOUT_FIELDS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "micro_batch_size", "gradient_accumulation_steps", "zero_stage",
                 "cpu_offload", "sequence_parallel", "recompute_activations", "recompute_granularity",
                 "recompute_method", "recompute_num_layers", "pipeline_schedule")
"""Config fields each candidate sets (the user's values for them are replaced)."""
LAYOUT_FLAGS = tuple(flag_for(name) for name in LAYOUT_FIELDS)
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


def validate_model_flags(model: Config) -> Config:
    """The user's model and batch flags validated once, at the layout every cluster has (TP = CP = PP = EP = 1 on
    one rank, no saver): a flag pretrain_gpt.py refuses there (--moe-router-topk above --num-experts, a
    --moe-layer-freq of the wrong length, ...) it refuses at every layout, so plan and calibrate say it in one line
    before enumerating or measuring anything. Raises ConfigError with validation's message."""
    return validate_candidate(candidate_config(model, Candidate(1, 1, 1, 1), None), 1)


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
    pipeline_schedule: str = "1f1b"
    """1f1b, or dualpipev where the plan predicts it faster and it fits (recipe.py `_faster_schedule`)."""
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
                f"_mb{self.micro_batch_size}{'_dualpipev' if self.pipeline_schedule == 'dualpipev' else ''}")


def candidate_config(base: Config, c: Candidate, offload_param_json: Optional[str]) -> Config:
    """The user's (unvalidated) config with the candidate's layout."""
    extra = {"training__deepspeed_config": offload_param_json} if c.offload_param else {}
    return base.replace(
        parallel__tensor_model_parallel_size=c.tensor_model_parallel_size,
        parallel__context_parallel_size=c.context_parallel_size,
        parallel__pipeline_model_parallel_size=c.pipeline_model_parallel_size,
        parallel__expert_model_parallel_size=c.expert_model_parallel_size,
        parallel__zero_stage=c.zero_stage, parallel__cpu_offload=c.cpu_offload,
        parallel__sequence_parallel=c.sequence_parallel, parallel__pipeline_schedule=c.pipeline_schedule,
        batch__micro_batch_size=c.micro_batch_size, batch__gradient_accumulation_steps=None,
        model__recompute_activations=False, model__recompute_granularity=c.recompute_granularity,
        model__recompute_method=c.recompute_method, model__recompute_num_layers=c.recompute_num_layers, **extra)


SAVER_FLAGS = ("cpu_offload", "sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers")


def layout_argv(c: Candidate, config: Config) -> List[str]:
    """A candidate's layout flags, TP / CP / PP / micro batch / ZeRO always spelled out, EP too for an MoE model,
    the savers and --pipeline-schedule where not the default (and the DeepSpeed JSON that asks for ZeRO-3 parameter
    offload, which replaces the user's)."""
    shown = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
             "micro_batch_size", "zero_stage")
    if config.model.num_experts is not None:
        shown += ("expert_model_parallel_size",)
    return (config_to_argv(config, fields=shown, include_defaults=True)
            + config_to_argv(config, fields=SAVER_FLAGS + ("pipeline_schedule",))
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


def context_parallel_sizes(model: Config, tp: int, world: int, limit: Optional[int] = None) -> List[int]:
    """CP degrees to try at TP tp: 1, 2, 4, ... dividing the ranks TP leaves, up to the heads per TP rank
    (each CP rank attends with whole heads) and `limit`. Validation refuses those the heads, groups or
    sequence do not divide, with its reason."""
    most = max(model.model.num_attention_heads // tp, 1)
    if limit is not None:
        most = min(most, limit)
    return [c for c in (2 ** k for k in range(most.bit_length())) if c <= most and (world // tp) % c == 0]
