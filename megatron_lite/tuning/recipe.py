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
memory come from cost/arithmetic.py and cost/memory.py, which know GPT-2's
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

EP partitions the routed experts' weights and optimizer states (cost/memory.py books E/EP experts per
rank, their states over DP x CP / EP), so it is a memory saver of its own, paid for in all-to-alls
(tuning/throughput.py `Experts`).

--optimizer muon among the model flags plans with Muon: cost/memory.py books its one moment per matrix and
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
At PP > 1 each fitting candidate is priced under --pipeline-schedule dualpipev too (`_faster_schedule`): the
same layout and saver, where validation allows it (gas >= 2 x PP, 2 x PP stages with a layer each) and its
peak fits (each rank keeps about the first 1F1B stage's activations); the plan keeps the schedule it predicts
faster (cost/pipeline_efficiency.py: the V's smaller bubble, the ranks' two stages' balance) and records the
other's step in predicted_parts.
Samyam's micro-batch probe (`micro_batch_probe`): one node, the model cut to a
few layers at full hidden size, PP = 1, micro batch 1..64 at gas 1.

This module runs the recipe (`plan`); candidates.py makes the layouts, savers and candidates'
configs, pricing.py predicts their step and holds the order's key, plan_output.py the Plan and its table.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict
from typing import List, Optional, Sequence, Tuple

from megatron_lite.arguments import build_parser, config_to_argv, given_fields
from megatron_lite.atomic import write_text
from megatron_lite.config import Config, ConfigError, flag_for
from megatron_lite.cost import memory
from megatron_lite.model.moe_options import layer_freq_for
from megatron_lite.tuning.calibration import Profile
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning.candidates import (Candidate, LAYOUT_FIELDS, OFFLOAD_PARAM, OFFLOAD_PARAM_JSON, _try_savers,
                                             candidate_config, context_parallel_sizes, divisors,
                                             expert_parallel_sizes, layout_argv, validate_candidate,
                                             validate_model_flags)
from megatron_lite.tuning.plan_output import Plan
from megatron_lite.tuning.pricing import _layout_kind, _predict, _shaden_key, _unmeasured, generic_scale
from megatron_lite.tuning.throughput import Hardware


def plan(model_argv: Sequence[str], nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         memory_margin: float = 0.1, max_micro_batch: int = 8, order: str = "shaden",
         hardware: Optional[Hardware] = None, device: str = "cuda", workdir: Optional[str] = ".",
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
    validate_model_flags(model)  # before any layout is tried or anything is written
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
    if workdir is None:  # nothing is written before the model flags are validated
        workdir = tempfile.mkdtemp(prefix="plan_")
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
                    c = _faster_schedule(c, config, planned, model_fields, world, budget, device, offload_param_json,
                                         hw, profile)
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


def _faster_schedule(c: Candidate, config: Config, model: Config, model_fields: Sequence[str], world: int,
                     budget: int, device: str, offload_param_json: str, hw: Hardware,
                     profile: Optional[Profile]) -> Candidate:
    """`c` (priced, 1f1b) or the same layout and saver under --pipeline-schedule dualpipev, whichever is predicted
    faster; dualpipev only where validation allows it and its peak fits `budget`. The chosen one's predicted_parts
    hold the other's step (`<schedule>_step_seconds`)."""
    if c.pipeline_model_parallel_size == 1:
        return c
    other = Candidate(**{**asdict(c), "pipeline_schedule": "dualpipev", "argv": [], "pretrain_argv": [],
                         "predicted_parts": {}})
    planned = candidate_config(model, other, offload_param_json)
    try:
        other_config = validate_candidate(planned, world)
    except ConfigError:
        return c
    stages = memory.estimate(other_config, deepspeed_config(other_config), device=device)
    if max(st.peak for st in stages) > budget:
        return c
    other.peak_bytes_per_stage = [st.peak for st in stages]
    other.stage_memory = [st.to_dict() for st in stages]
    other.argv = layout_argv(other, planned)
    shown = [f for f in model_fields if not (other.offload_param and f == "deepspeed_config")]
    other.pretrain_argv = config_to_argv(planned, fields=shown, include_defaults=True) + other.argv
    _predict(other, other_config, hw, profile)
    faster, slower = (other, c) if other.predicted_step_seconds < c.predicted_step_seconds else (c, other)
    faster.predicted_parts[f"{slower.pipeline_schedule}_step_seconds"] = slower.predicted_step_seconds
    return faster


_SAVER_FIELDS = ("zero_stage", "cpu_offload", "sequence_parallel", "recompute_activations", "recompute_granularity",
                 "recompute_method", "recompute_num_layers")


def _shown(value) -> str:
    return "" if value is True else str(value)
