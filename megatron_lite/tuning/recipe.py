"""The tuning recipe: candidate TP / PP / micro-batch / gas layouts for a cluster and a model.

Candidates come from the cluster shape: TP divides the GPUs per node, PP
divides the GPUs left (layers need not divide: the cost partitioner balances
and the imbalance shows in the predicted efficiency), DP is the rest, micro
batch 1, 2, 4, ... and gas from the global batch. Every candidate goes through
the validation pretrain_gpt.py runs (`validate_candidate`, the one call site),
so a planned layout is never refused at launch. Then the memory savers are
tried, fastest first (design notes: ZeRO 0 > 1 > 2 > 2 + optimizer offload >
3 > 3 + parameter offload, 2 and 3 only at PP = 1), each first without and then
with activation recompute; the first whose predicted peak on every stage fits
the GPU less the margin is kept, and the plan says which saver that was.

Order (default `shaden`): layouts with gas >= 8 x PP (bubble <= ~11%) first,
then TP closest to the GPUs per node, then the saver tier (ZeRO 0/1 alone,
then with recompute, then ZeRO 2/3/offload: stages are added only when the
cheap savers do not fit), the fewest stages, micro batch 1 before larger ones,
and predicted throughput last. `throughput`
orders by the predicted tokens/s of tuning/throughput.py alone.
Samyam's micro-batch probe (`micro_batch_probe`): one node, the model cut to a
few layers at full hidden size, PP = 1, micro batch 1..64 at gas 1.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_lite.arguments import build_parser, parse_args
from megatron_lite.config import Config, ConfigError
from megatron_lite.model.gpt import spec_costs
from megatron_lite.model.pipeline_efficiency import predicted_pipeline_efficiency
from megatron_lite.tuning import memory
from megatron_lite.tuning.throughput import Hardware, predict_step_seconds

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                "--gradient-accumulation-steps", "--zero-stage", "--cpu-offload", "--recompute-activations")
ZERO_LADDER = ((0, False, False), (1, False, False), (2, False, False), (2, True, False), (3, False, False),
               (3, True, True))
"""(ZeRO stage, optimizer offload, parameter offload), fastest first."""
OFFLOAD_PARAM_JSON = "zero3_offload_param.json"


def validate_candidate(argv: Sequence[str], world_size: int) -> Config:
    """The validation pretrain_gpt.py runs; raises ConfigError with its message. The one call site."""
    return parse_args(list(argv), world_size)[0]


def strip_flags(argv: Sequence[str], flags: Sequence[str]) -> List[str]:
    """argv without the given pretrain_gpt.py flags (and their values, as the shared parser defines them)."""
    actions = build_parser()._option_string_actions
    out, i, argv = [], 0, list(argv)
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in flags:
            nargs = actions[name].nargs
            takes = 0 if nargs == 0 else (nargs if isinstance(nargs, int) else 1)
            i += 1 + (0 if "=" in token else takes)
            continue
        out.append(token)
        i += 1
    return out


@dataclass
class Candidate:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int = 0
    zero_stage: int = 0
    cpu_offload: bool = False
    offload_param: bool = False
    recompute_activations: bool = False
    saver: str = ""
    """The memory saver that made it fit ("none" when the fastest setting fits)."""
    peak_bytes_per_stage: List[int] = field(default_factory=list)
    stage_memory: List[Dict[str, Any]] = field(default_factory=list)
    predicted_pipeline_efficiency: float = 0.0
    predicted_step_seconds: float = 0.0
    predicted_tokens_per_s: float = 0.0
    predicted_relative_throughput: float = 0.0
    argv: List[str] = field(default_factory=list)
    """The pretrain_gpt.py layout flags of this candidate (added to the model flags)."""
    rank: int = 0
    throughput_rank: int = 0
    name: str = ""

    @property
    def layout(self) -> str:
        return (f"tp{self.tensor_model_parallel_size}_pp{self.pipeline_model_parallel_size}_"
                f"dp{self.data_parallel_size}_mb{self.micro_batch_size}")


def saver_name(zero: int, offload: bool, offload_param: bool, recompute: bool) -> str:
    parts = [f"ZeRO {zero}"] if zero else []
    if offload_param:
        parts.append("parameter + optimizer offload")
    elif offload:
        parts.append("optimizer offload")
    if recompute:
        parts.append("activation recompute")
    return " + ".join(parts) or "none"


def layout_argv(c: Candidate, offload_param_json: Optional[str]) -> List[str]:
    argv = ["--tensor-model-parallel-size", str(c.tensor_model_parallel_size),
            "--pipeline-model-parallel-size", str(c.pipeline_model_parallel_size),
            "--micro-batch-size", str(c.micro_batch_size), "--zero-stage", str(c.zero_stage)]
    if c.cpu_offload:
        argv.append("--cpu-offload")
    if c.offload_param:
        argv += ["--deepspeed-config", offload_param_json]
    if c.recompute_activations:
        argv.append("--recompute-activations")
    return argv


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=None)
def _stage_shape(model_config, pp: int, method: str) -> Tuple[Tuple[float, ...], Tuple[int, ...]]:
    """Per-stage forward FLOPs per token and transformer layers (cached: the partition DP is the slow part)."""
    config = Config(model=model_config).replace(parallel__pipeline_model_parallel_size=pp,
                                                parallel__pipeline_partition_method=method)
    costs = spec_costs(config)
    bounds = memory.stage_bounds(config)
    flops = tuple(sum(c.flops for c in costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    layers = tuple(sum(c.is_transformer for c in costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    return flops, layers


@dataclass
class Plan:
    mode: str
    cluster: Dict[str, Any]
    model_argv: List[str]
    memory_budget_bytes: int
    candidates: List[Candidate]
    rejected: List[Dict[str, Any]]

    def to_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "cluster": self.cluster, "model_argv": self.model_argv,
                "memory_budget_bytes": self.memory_budget_bytes,
                "candidates": [dict(asdict(c), layout=c.layout) for c in self.candidates],
                "rejected": self.rejected}

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)


def _try_savers(base: Candidate, model_argv: List[str], world: int, budget: int, device: str,
                offload_param_json: str) -> Tuple[Optional[Candidate], Optional[Config], str]:
    """The first saver that fits, or (None, None, reason)."""
    pp = base.pipeline_model_parallel_size
    last_reason = ""
    smallest = None
    for zero, offload, offload_param in ZERO_LADDER:
        if pp > 1 and zero >= 2:
            continue
        for recompute in (False, True):
            c = Candidate(**{**asdict(base), "zero_stage": zero, "cpu_offload": offload,
                             "offload_param": offload_param, "recompute_activations": recompute})
            argv = strip_flags(model_argv, LAYOUT_FLAGS) + layout_argv(c, offload_param_json)
            try:
                config = validate_candidate(argv, world)
            except ConfigError as e:
                last_reason = str(e)
                continue
            stages = memory.estimate(config, device=device)
            peaks = [st.peak for st in stages]
            if smallest is None or max(peaks) < max(smallest[0]):
                smallest = (peaks, saver_name(zero, offload, offload_param, recompute))
            if max(peaks) <= budget:
                c.saver = saver_name(zero, offload, offload_param, recompute)
                c.gradient_accumulation_steps = config.batch.gradient_accumulation_steps
                c.peak_bytes_per_stage = peaks
                c.stage_memory = [st.to_dict() for st in stages]
                c.argv = layout_argv(c, offload_param_json)
                return c, config, ""
    if smallest is None:
        return None, None, last_reason
    worst = max(range(len(smallest[0])), key=lambda i: smallest[0][i])
    return None, None, (f"does not fit: even with {smallest[1]} stage {worst} needs "
                        f"{smallest[0][worst] / memory.GIB:.1f} GiB > budget {budget / memory.GIB:.1f} GiB")


def _predict(c: Candidate, config: Config, hw: Hardware) -> None:
    m = config.model
    flops, layers = _stage_shape(m, c.pipeline_model_parallel_size, config.parallel.pipeline_partition_method)
    params = [st["parameters"] for st in c.stage_memory]
    times = predict_step_seconds(flops, layers, params, hw, hidden=m.hidden_size, seq=m.seq_length,
                                 tp=c.tensor_model_parallel_size, pp=c.pipeline_model_parallel_size,
                                 dp=c.data_parallel_size, micro=c.micro_batch_size,
                                 gas=c.gradient_accumulation_steps, zero_stage=c.zero_stage,
                                 recompute=c.recompute_activations, cpu_offload=c.cpu_offload)
    c.predicted_pipeline_efficiency = predicted_pipeline_efficiency(list(flops), c.gradient_accumulation_steps)
    c.predicted_step_seconds = times["step_seconds"]
    c.predicted_tokens_per_s = config.batch.global_batch_size * m.seq_length / times["step_seconds"]


SAVERS = [saver_name(*z, r) for z in ZERO_LADDER for r in (False, True)]


def saver_tier(c: Candidate) -> int:
    """0: ZeRO 0/1 alone; 1: with activation recompute; 2: ZeRO 2/3 or offload (the slow savers)."""
    if c.zero_stage >= 2 or c.cpu_offload:
        return 2
    return 1 if c.recompute_activations else 0


def _shaden_key(c: Candidate, gpus_per_node: int):
    # Pipeline stages are added only where the cheap savers do not make fewer stages fit.
    return (c.gradient_accumulation_steps < 8 * c.pipeline_model_parallel_size,
            abs(math.log2(c.tensor_model_parallel_size / gpus_per_node)),
            saver_tier(c), c.pipeline_model_parallel_size, c.micro_batch_size, SAVERS.index(c.saver),
            -c.predicted_tokens_per_s)


def plan(model_argv: Sequence[str], nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         memory_margin: float = 0.1, max_micro_batch: int = 8, order: str = "shaden",
         hardware: Optional[Hardware] = None, device: str = "cuda", workdir: str = ".",
         micro_batch_probe: bool = False, probe_layers: int = 2, progress=None) -> Plan:
    """Candidates for the cluster, validated, memory-checked, predicted and ordered."""
    hw = hardware or Hardware(gpus_per_node=gpus_per_node)
    model_argv = list(model_argv)
    mode = "micro-batch-probe" if micro_batch_probe else "layout"
    if micro_batch_probe:
        nodes = 1
        model_argv = strip_flags(model_argv, ("--num-layers", "--global-batch-size")) + \
            ["--num-layers", str(probe_layers)]
        max_micro_batch = max(max_micro_batch, 64)
    world = nodes * gpus_per_node
    budget = int(gpu_memory_gb * memory.GIB * (1.0 - memory_margin))
    os.makedirs(workdir, exist_ok=True)
    offload_param_json = os.path.join(workdir, OFFLOAD_PARAM_JSON)
    with open(offload_param_json, "w") as f:
        json.dump({"zero_optimization": {"offload_param": {"device": "cpu"}}}, f)

    micro_sizes = [2 ** k for k in range(int(math.log2(max_micro_batch)) + 1)]
    kept, rejected = [], []
    tps = divisors(gpus_per_node)
    for tp in tps:
        for pp in ([1] if micro_batch_probe else divisors(world // tp)):
            dp = world // (tp * pp)
            for micro in micro_sizes:
                base = Candidate(tp, pp, dp, micro)
                extra = ["--global-batch-size", str(micro * dp)] if micro_batch_probe else []
                c, config, reason = _try_savers(base, model_argv + extra, world, budget, device, offload_param_json)
                if c is None:
                    rejected.append({"layout": base.layout, "tensor_model_parallel_size": tp,
                                     "pipeline_model_parallel_size": pp, "data_parallel_size": dp,
                                     "micro_batch_size": micro, "reason": reason})
                    continue
                if micro_batch_probe:
                    c.argv += extra
                _predict(c, config, hw)
                kept.append(c)
                if progress:
                    progress(len(kept), len(rejected))
    best = max((c.predicted_tokens_per_s for c in kept), default=1.0)
    for c in kept:
        c.predicted_relative_throughput = c.predicted_tokens_per_s / best
    for i, c in enumerate(sorted(kept, key=lambda c: -c.predicted_tokens_per_s), 1):
        c.throughput_rank = i
    if order == "throughput" or micro_batch_probe:
        kept.sort(key=lambda c: c.throughput_rank)
    else:
        kept.sort(key=lambda c: _shaden_key(c, gpus_per_node))
    for i, c in enumerate(kept, 1):
        c.rank = i
        c.name = f"{i:03d}_{c.layout}"
    cluster = {"nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_memory_gb": gpu_memory_gb,
               "memory_margin": memory_margin, "order": order, "device": device, "hardware": asdict(hw)}
    return Plan(mode, cluster, model_argv, budget, kept, rejected)


def rejection_kind(reason: str) -> str:
    """A short class of a rejection reason, to group them in the table."""
    for needle, kind in (("does not fit", "does not fit in memory"),
                         ("smaller than --pipeline-model-parallel-size", "layers fewer than stages"),
                         ("is not divisible by --tensor-model-parallel-size", "not divisible by TP"),
                         ("--global-batch-size", "global batch not divisible by micro x DP"),
                         ("not divisible by --num-attention-heads", "hidden not divisible by heads")):
        if needle in reason:
            return kind
    return reason.split(";")[0][:80]


def format_plan(p: Plan, limit: int = 30) -> str:
    lines = [f"{'rank':>4} {'thr.rank':>8} {'TP':>3} {'PP':>3} {'DP':>4} {'micro':>5} {'gas':>5} "
             f"{'peak GiB (stages)':>24} {'pipe eff':>8} {'rel. thr':>8}  saver"]
    for c in p.candidates[:limit]:
        peaks = [x / memory.GIB for x in c.peak_bytes_per_stage]
        peak_txt = (f"{max(peaks):.3g} ({peaks[0]:.3g}..{peaks[-1]:.3g})" if len(peaks) > 1
                    else f"{peaks[0]:.3g}")
        lines.append(f"{c.rank:>4} {c.throughput_rank:>8} {c.tensor_model_parallel_size:>3} "
                     f"{c.pipeline_model_parallel_size:>3} {c.data_parallel_size:>4} {c.micro_batch_size:>5} "
                     f"{c.gradient_accumulation_steps:>5} {peak_txt:>24} {c.predicted_pipeline_efficiency:>8.3f} "
                     f"{c.predicted_relative_throughput:>8.3f}  {c.saver}")
    if len(p.candidates) > limit:
        lines.append(f"... {len(p.candidates) - limit} more in the JSON")
    kinds: Dict[str, List[str]] = {}
    for r in p.rejected:
        kinds.setdefault(rejection_kind(r["reason"]), []).append(r["layout"])
    lines.append(f"{len(p.candidates)} candidates kept, {len(p.rejected)} rejected (every reason in the JSON):")
    for kind, layouts in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(layouts[:4]) + (", ..." if len(layouts) > 4 else "")
        lines.append(f"  {len(layouts):>4} x {kind}: {shown}")
    return "\n".join(lines)
