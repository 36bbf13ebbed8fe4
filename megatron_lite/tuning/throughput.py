"""A simple, documented model of training speed, to rank layouts before running any.

One optimizer step of a layout (TP t, CP c, PP p, DP n, micro batch b, gas g), with s = b S / c the
tokens of a micro-batch a rank holds (S the sequence; context parallelism splits it c ways):

  step = (g + p - 1) x max over stages (compute_i + tp_comm_i + cp_comm_i + ep_comm_i) + p2p + dp_comm + offload

  compute_i  = (3 x stage forward FLOPs + what recompute runs again on the stage: cost/arithmetic.py
               `recompute_forward_flops_per_token`) x b S / (t c) / (peak x gemm_eff(s))
               gemm_eff(tokens) = tokens / (tokens + 256): small matrices run below peak
               (context parallelism splits the attention core by heads and the rest by tokens)
  tp_comm_i  = layers_i x 4 all-reduces x 2 (t-1)/t x (s h x 2 bytes) / bandwidth
               (forward and backward, two per layer each; NVLink when the TP group sits in a node;
               sequence parallelism replaces each by a reduce-scatter and an all-gather, the same bytes)
  cp_comm_i  = (2 layers_i + recomputed layers_i) x (c-1)/c x A / bandwidth
               A = the bytes of one layer's two forward all-to-alls on a rank (q, k, v in, the context
               out: cost/activations.py `context_parallel_all_to_all_bytes`), each rank sending
               (c-1)/c of them; backward moves their gradients, full recompute runs the forward ones
               again. CP ranks follow the TP ranks (rank order pipe, data, model with data = DP x c + CP),
               so the group sits in a node when t c <= GPUs per node
  p2p        = 2 (g + p - 1) x s h x 2 bytes / bandwidth between consecutive stages (/ t with
               sequence parallelism: a stage sends its sequence shard)
  dp_comm    = 2 (N-1)/N x stage parameters x 2 bytes / bandwidth, N = n c (gradients are reduced
               over DP x CP); ZeRO 3 moves 1.5x that. Routed experts' gradients go over the N/e ranks
               holding the same experts instead (expert-DP), the rest over N
  offload    = 16 bytes x partition parameters / host bandwidth (CPU Adam and the copies)

Mixture of Experts with expert parallelism e (EP, `Experts`; a dense model has no such terms): an MoE
layer sends its N = T k routed copies (T = b S / c the tokens a rank dispatches: every TP rank dispatches
all of them; fewer copies with a capacity, cost/activations.py `routed_copies`) to the experts' ranks and
brings the outputs back, one all-to-all each; backward runs the mirror pair, full recompute the forward
pair again. Each rank keeps 1/e of the rows and sends (e-1)/e:
  ep_comm_i  = (4 moe_i + 2 recomputed moe_i) x (e-1)/e x R / bandwidth,   R = N h x 2 bytes
               (moe_i: the stage's MoE layers). EP ranks are consecutive places of DP x CP, so the group
               spans t e ranks and sits in a node when t e <= GPUs per node, the network beyond
  experts    in compute_i the routed experts' GEMMs run at gemm_eff(e N / E), not gemm_eff(s): E/e local
               experts each get the copies of e ranks (balanced routing), so EP grows the expert GEMMs as
               it shrinks the experts a rank holds

--optimizer muon adds its step (cost/muon.py `MuonWork`, the slowest stage's) after the pipeline:
  muon       = Newton-Schulz FLOPs / (matmul rate x gemm_eff(m)) + 2 (N-1)/N x assembled bytes / bandwidth
               + (t-1)/t x gathered bytes / bandwidth(TP)
               the rate by --muon-fp32-matmul-prec: highest the fp32 peak (`fp32_tflops`), high TF32 at half
               the 16-bit peak, medium the 16-bit peak; m the largest part's smaller side; the assembled U is
               fp32 (4 bytes a value) over the partition's ranks (experts' over N / EP), the gathered matrices
               fp32 over TP (duplicated mode)

The (g + p - 1) x max term is the 1F1B schedule (bubble x balance, see
cost/pipeline_efficiency.py). Under --pipeline-schedule dualpipev (`schedule`) the stage lists are the pipeline
ranks' (two stages each), p - 1 becomes DualPipeV's bubble in such periods (pipeline_efficiency.bubble_periods:
(5p - 6) / 6 at B = 2F), each rank sends twice as often (activations and gradients of both stages, p2p x 2), the
loss stage is rank 0, and the tied embedding and head are one module (no tied all-reduce). Tokens/s = global batch x S / step. The numbers
are for ranking layouts against each other; only the sweep measures.

With a measured profile (tuning/calibration.py, `tune_parallelism.py calibrate`) the constants give way
to measurements: peak x gemm_eff(s) becomes the GEMM FLOP/s measured at s tokens (interpolated), and
each communication term becomes latency x messages + bytes / bandwidth of that collective at that group
size, with the bytes the caller's tensor (the profile's bandwidth includes the ring factors), in the
model's activation dtype (bytes_per_value: 4 for fp32 training):
  tp_comm_i  = layers_i x 4 all-reduces of s h values (sequence parallelism: a reduce-scatter and an
               all-gather each)
  cp_comm_i  = (2 layers_i + recomputed layers_i) x 2 all-to-alls of A/2 bytes each
  ep_comm_i  = the profile's all-to-all over e ranks of R bytes, 4 per MoE layer (2 forward, 2 backward)
               and 2 per recomputed one, and a message more per forward for the row counts dispatch
               exchanges first (parallel/experts.py); a fit measured at e ranks has the (e-1)/e share
               leaving a rank in its bandwidth, another group size is scaled by that share
  p2p        = 2 (g + p - 1) sends of s h values (/ t with sequence parallelism)
  dp_comm    = one all-reduce of the stage's parameters over n c ranks, a message per 500 MB bucket;
               ZeRO 3 1.5x; routed experts' over n c / e ranks
  offload    = 16 bytes x partition parameters / measured copy bandwidth
  muon       = Newton-Schulz FLOPs at the GEMM rate measured at m rows, the all-reduces of the assembled U
               (a message per ASSEMBLY_ELEMENTS) and the TP all-gathers (a message per matrix) from their fits
The profile measures one machine: groups that cross nodes are priced as the local ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_lite.cost.muon import MuonWork
from megatron_lite.cost.pipeline_efficiency import bubble_periods
from megatron_lite.tuning.calibration import Profile

DP_BUCKET_BYTES = 5e8
"""Gradient bytes per all-reduce message (DeepSpeed's default reduce bucket: 5e8 elements, taken as bytes)."""


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    peak_tflops: float = 312.0
    """Dense 16-bit peak per GPU (A100: 312, H100: 989)."""
    intra_node_gbps: float = 150.0
    """All-reduce bus bandwidth inside a node, GB/s (NVLink)."""
    inter_node_gbps: float = 25.0
    """Per-GPU network bandwidth across nodes, GB/s."""
    host_gbps: float = 20.0
    """Host memory bandwidth one rank gets for offloaded optimizer work, GB/s."""
    fp32_tflops: float = 19.5
    """fp32 matmul peak per GPU without TF32 (A100: 19.5, H100: 67): Muon's Newton-Schulz at
    --muon-fp32-matmul-prec highest."""


def muon_seconds(work: Optional[Sequence[MuonWork]], flops_rate, all_reduce, all_gather) -> float:
    """The slowest stage's Muon step (module docstring): `flops_rate(rows)` FLOP/s, `all_reduce(bytes, ranks,
    messages)` and `all_gather(bytes, messages)` seconds (over TP)."""
    if not work:
        return 0.0
    return max((w.flops / flops_rate(w.rows) if w.flops else 0.0)
               + sum(all_reduce(nbytes, ranks, w.messages(nbytes)) for nbytes, ranks in w.all_reduces)
               + (all_gather(w.all_gather_bytes, w.all_gathers) if w.all_gathers else 0.0) for w in work)


@dataclass(frozen=True)
class Experts:
    """What a layout's routed experts add to the step (module docstring, Mixture of Experts)."""
    ep: int
    """Expert-parallel ranks (1: every rank holds every expert and nothing is sent)."""
    stage_moe_layers: Sequence[int]
    """MoE layers on each stage."""
    stage_recomputed_moe_layers: Sequence[int]
    """MoE layers of each stage whose forward (all-to-alls included) full recompute runs again."""
    all_to_all_bytes: float
    """R: the rows one dispatch all-to-all moves on a rank per micro-batch (sent copies x h x bytes per value)."""
    stage_parameters: Sequence[int]
    """The routed experts' parameters one rank of each stage holds (part of the stage's parameters), whose
    gradients are reduced over expert-DP (DP x CP / EP)."""
    layer_flops_per_token: float
    """Forward FLOPs per token of one MoE layer's routed experts (part of the stage FLOPs): k expert MLPs."""
    rows_per_expert: float
    """Rows a local expert's GEMM gets per micro-batch (EP x the copies a rank sends / experts)."""


def ep_all_to_all_seconds(experts: Optional[Experts], moe_layers: int, recomputed: int, price) -> float:
    """A stage's expert all-to-alls per micro-batch, `price(bytes, messages)`: R bytes each, 4 per MoE layer
    (dispatch and combine, forward and backward) and 2 per MoE layer full recompute runs again; messages
    count the calls, with the exchange of row counts before each forward dispatch (parallel/experts.py)."""
    if experts is None or experts.ep == 1 or not moe_layers:
        return 0.0
    return price((4 * moe_layers + 2 * recomputed) * experts.all_to_all_bytes, 5 * moe_layers + 3 * recomputed)


def gemm_efficiency(tokens: int) -> float:
    return tokens / (tokens + 256.0)


def pipeline_periods(schedule: str, gas: int, pp: int) -> float:
    """The step's pipeline in periods of the slowest rank's micro-batch: gas + the fill and drain."""
    return gas + (bubble_periods(schedule, pp) if pp > 1 else 0.0)


def p2p_sends(schedule: str, gas: int, pp: int) -> float:
    """A rank's activation and gradient sends per step (module docstring): 2 x pipeline_periods, twice that under
    dualpipev; 0 without a pipeline."""
    if pp == 1:
        return 0.0
    return 2 * pipeline_periods(schedule, gas, pp) * (2 if schedule == "dualpipev" else 1)


def predict_step_seconds(stage_flops_per_token: Sequence[float], stage_layers: Sequence[int],
                         stage_parameters: Sequence[int], hw: Hardware, *, hidden: int, seq: int,
                         tp: int, pp: int, dp: int, micro: int, gas: int, zero_stage: int,
                         recompute_flops: Sequence[float], cpu_offload: bool,
                         sequence_parallel: bool = False, cp: int = 1, cp_all_to_all_bytes: int = 0,
                         recomputed_layers: Sequence[int] = (), profile: Optional[Profile] = None,
                         bytes_per_value: int = 2, experts: Optional[Experts] = None,
                         muon: Optional[Sequence[MuonWork]] = None, muon_precision: str = "highest",
                         schedule: str = "1f1b") -> Dict[str, float]:
    """The stage lists are per pipeline rank (two stages each under schedule dualpipev).
    recompute_flops: forward FLOPs per token that activation recompute runs again, per stage;
    cp_all_to_all_bytes: A above; recomputed_layers: layers per stage whose forward full recompute runs again;
    profile: measured hardware instead of hw's constants (bytes_per_value is used with it only);
    experts: the routed experts of an MoE model (None: a dense model). ep_comm_seconds in the result: the
    slowest stage's expert all-to-alls per micro-batch. muon: each stage's Muon step under --optimizer muon
    (muon_precision: its --muon-fp32-matmul-prec), priced as muon_seconds."""
    if profile is not None:
        return _predict_with_profile(stage_flops_per_token, stage_layers, stage_parameters, profile, hidden=hidden,
                                     seq=seq, tp=tp, pp=pp, dp=dp, micro=micro, gas=gas, zero_stage=zero_stage,
                                     recompute_flops=recompute_flops, cpu_offload=cpu_offload,
                                     sequence_parallel=sequence_parallel, cp=cp,
                                     cp_all_to_all_bytes=cp_all_to_all_bytes, recomputed_layers=recomputed_layers,
                                     bytes_per_value=bytes_per_value, experts=experts, muon=muon, schedule=schedule)
    tokens = micro * seq // cp
    rate = lambda rows: hw.peak_tflops * 1e12 * gemm_efficiency(rows)  # noqa: E731
    gbps = lambda inside_node: (hw.intra_node_gbps if inside_node else hw.inter_node_gbps) * 1e9  # noqa: E731
    tp_bw = gbps(tp <= hw.gpus_per_node)
    cp_bw = gbps(tp * cp <= hw.gpus_per_node)
    act_bytes = tokens * hidden * 2
    recomputed = list(recomputed_layers) or [0] * len(stage_layers)
    moe = _stage_experts(experts, len(stage_layers))
    ep = experts.ep if experts is not None else 1
    ep_bw = gbps(tp * ep <= hw.gpus_per_node)  # EP ranks: t e consecutive ranks (module docstring)
    all_to_all = lambda nbytes, messages: (ep - 1) / ep * nbytes / ep_bw  # noqa: E731
    per_stage: List[float] = []
    ep_comms: List[float] = []
    cp_comms: List[float] = []
    for flops, again, layers, redone, (moe_layers, moe_redone) in zip(
            stage_flops_per_token, recompute_flops, stage_layers, recomputed, moe):
        compute = _compute_seconds(flops, again, moe_layers, moe_redone, experts, tokens / tp, rate(tokens), rate)
        tp_comm = layers * 4 * 2 * (tp - 1) / tp * act_bytes / tp_bw if tp > 1 else 0.0
        cp_comm = (2 * layers + redone) * (cp - 1) / cp * cp_all_to_all_bytes / cp_bw if cp > 1 else 0.0
        ep_comm = ep_all_to_all_seconds(experts, moe_layers, moe_redone, all_to_all)
        per_stage.append(compute + tp_comm + cp_comm + ep_comm)
        ep_comms.append(ep_comm)
        cp_comms.append(cp_comm)
    # Rank order is (pipe, data, model), data = DP x CP: a stage spans tp x cp x dp consecutive ranks.
    sent = act_bytes / tp if sequence_parallel else act_bytes
    stage_ranks = tp * cp * dp
    p2p = p2p_sends(schedule, gas, pp) * sent / gbps(stage_ranks * 2 <= hw.gpus_per_node)
    reduced = dp * cp  # gradients are reduced over DP x CP, the routed experts' over DP x CP / EP

    def all_reduce(parameters: float, ranks: int) -> float:
        return 2 * (ranks - 1) / ranks * parameters * 2 / gbps(stage_ranks <= hw.gpus_per_node) if ranks > 1 else 0.0

    dp_comm = max(all_reduce(params - expert, reduced) + all_reduce(expert, reduced // ep)
                  for params, expert in zip(stage_parameters, _expert_parameters(experts, stage_parameters))
                  ) * (1.5 if zero_stage == 3 else 1.0)
    largest = max(stage_parameters)
    offload = 16.0 * largest / reduced / (hw.host_gbps * 1e9) if cpu_offload else 0.0
    matmul = {"highest": hw.fp32_tflops, "high": hw.peak_tflops / 2}.get(muon_precision, hw.peak_tflops) * 1e12
    stage_bw = gbps(stage_ranks <= hw.gpus_per_node)
    optimizer = muon_seconds(muon, lambda rows: matmul * gemm_efficiency(rows),
                             lambda nbytes, ranks, messages: 2 * (ranks - 1) / ranks * nbytes / stage_bw,
                             lambda nbytes, messages: (tp - 1) / tp * nbytes / tp_bw)
    return _step(per_stage, ep_comms, cp_comms, gas, pp, p2p, dp_comm, offload, optimizer, schedule)


def _stage_experts(experts: Optional[Experts], stages: int) -> List[Tuple[int, int]]:
    """(MoE layers, recomputed MoE layers) per stage; zeros for a dense model."""
    if experts is None:
        return [(0, 0)] * stages
    return list(zip(experts.stage_moe_layers, experts.stage_recomputed_moe_layers))


def _expert_parameters(experts: Optional[Experts], stage_parameters: Sequence[int]) -> Sequence[int]:
    return experts.stage_parameters if experts is not None else [0] * len(stage_parameters)


def _compute_seconds(flops: float, again: float, moe_layers: int, moe_redone: int, experts: Optional[Experts],
                     tokens_per_tp_rank: float, dense_rate: float, rate) -> float:
    """A stage's compute per micro-batch: 3 x forward + recompute, the routed experts' part at the rate of
    their GEMMs' rows (`rate(rows)`), the rest at `dense_rate`."""
    expert = 0.0 if experts is None else (3.0 * moe_layers + moe_redone) * experts.layer_flops_per_token
    seconds = (3.0 * flops + again - expert) * tokens_per_tp_rank / dense_rate
    if expert:
        seconds += expert * tokens_per_tp_rank / rate(experts.rows_per_expert)
    return seconds


def _step(per_stage: List[float], ep_comms: List[float], cp_comms: List[float], gas: int, pp: int, p2p: float,
          dp_comm: float, offload: float, muon: float = 0.0, schedule: str = "1f1b") -> Dict[str, float]:
    """The step's terms: ep_comm_seconds and cp_comm_seconds are the slowest stage's per micro-batch."""
    slowest = max(range(len(per_stage)), key=lambda i: per_stage[i])
    pipeline = pipeline_periods(schedule, gas, pp) * per_stage[slowest]
    step = pipeline + p2p + dp_comm + offload + muon
    return {"step_seconds": step, "pipeline_seconds": pipeline, "dp_comm_seconds": dp_comm,
            "p2p_seconds": p2p, "offload_seconds": offload, "stage_seconds": per_stage[slowest],
            "ep_comm_seconds": ep_comms[slowest], "cp_comm_seconds": cp_comms[slowest],
            "muon_seconds": muon}


def _predict_with_profile(stage_flops_per_token: Sequence[float], stage_layers: Sequence[int],
                          stage_parameters: Sequence[int], profile: Profile, *, hidden: int, seq: int, tp: int,
                          pp: int, dp: int, micro: int, gas: int, zero_stage: int, recompute_flops: Sequence[float],
                          cpu_offload: bool, sequence_parallel: bool, cp: int, cp_all_to_all_bytes: int,
                          recomputed_layers: Sequence[int], bytes_per_value: int,
                          experts: Optional[Experts] = None, muon: Optional[Sequence[MuonWork]] = None,
                          schedule: str = "1f1b") -> Dict[str, float]:
    """The same terms as predict_step_seconds, priced by a measured profile (module docstring)."""
    tokens = micro * seq // cp
    comm = profile.collective_seconds
    act_bytes = tokens * hidden * bytes_per_value
    if sequence_parallel:
        tp_pair = comm("reduce_scatter", tp, act_bytes) + comm("all_gather", tp, act_bytes)
    else:
        tp_pair = comm("all_reduce", tp, act_bytes)
    recomputed = list(recomputed_layers) or [0] * len(stage_layers)
    ep = experts.ep if experts is not None else 1
    all_to_all = lambda nbytes, messages: comm("all_to_all", ep, nbytes, messages=messages)  # noqa: E731
    per_stage: List[float] = []
    ep_comms: List[float] = []
    cp_comms: List[float] = []
    moe = _stage_experts(experts, len(stage_layers))
    for flops, again, layers, redone, (moe_layers, moe_redone) in zip(
            stage_flops_per_token, recompute_flops, stage_layers, recomputed, moe):
        compute = _compute_seconds(flops, again, moe_layers, moe_redone, experts, tokens / tp,
                                   profile.gemm_flops_per_s(tokens), profile.gemm_flops_per_s)
        tp_comm = layers * 4 * tp_pair
        cp_comm = (2 * layers + redone) * comm("all_to_all", cp, cp_all_to_all_bytes, messages=2)
        ep_comm = ep_all_to_all_seconds(experts, moe_layers, moe_redone, all_to_all)
        per_stage.append(compute + tp_comm + cp_comm + ep_comm)
        ep_comms.append(ep_comm)
        cp_comms.append(cp_comm)
    sent = act_bytes / tp if sequence_parallel else act_bytes
    p2p = p2p_sends(schedule, gas, pp) * comm("send_recv", 2, sent) if pp > 1 else 0.0
    reduced = dp * cp

    def all_reduce(parameters: float, ranks: int) -> float:
        nbytes = parameters * bytes_per_value
        return comm("all_reduce", ranks, nbytes, messages=math.ceil(nbytes / DP_BUCKET_BYTES)) if nbytes else 0.0

    dp_comm = max(all_reduce(params - expert, reduced) + all_reduce(expert, reduced // ep)
                  for params, expert in zip(stage_parameters, _expert_parameters(experts, stage_parameters))
                  ) * (1.5 if zero_stage == 3 else 1.0)
    largest = max(stage_parameters)
    offload = 16.0 * largest / reduced / (profile.memory_gbps * 1e9) if cpu_offload else 0.0
    return _step(per_stage, ep_comms, cp_comms, gas, pp, p2p, dp_comm, offload,
                 profile_muon_seconds(profile, muon, tp), schedule)


def profile_muon_seconds(profile: Profile, muon: Optional[Sequence[MuonWork]], tp: int) -> float:
    """muon_seconds priced by a measured profile (module docstring)."""
    comm = profile.collective_seconds
    return muon_seconds(muon, profile.gemm_flops_per_s,
                        lambda nbytes, ranks, messages: comm("all_reduce", ranks, nbytes, messages=messages),
                        lambda nbytes, messages: comm("all_gather", tp, nbytes, messages=messages))


def predict_from_model_times(point: Dict[str, float], profile: Profile, *, world: int, stage_layers: Sequence[int],
                             stage_parameters: Sequence[int], calibration_parameters, tp: int, pp: int, dp: int,
                             micro: int, gas: int, hidden: int, seq: int, sequence_parallel: bool,
                             selective: bool, recomputed_layers: Sequence[int], tied_embedding_parameters: int,
                             bytes_per_value: int, zero_stage: int = 0, cpu_offload: bool = False,
                             muon: Optional[Sequence[MuonWork]] = None, cp: int = 1,
                             schedule: str = "1f1b") -> Dict[str, float]:
    """A step priced by the model's own measured times (tuning/measure_model.py) at this TP, CP, EP and micro
    batch (a layer's and the ends' times at CP c are those of the rank's S / c tokens, the CP all-to-alls
    included; at EP e the expert all-to-alls and the experts' GEMMs at their rows):

      stage_i  = L_i x layer + (L_i - R_i) x extra + R_i x full_extra + ends [last stage] + engine_per_micro,
                 per micro-batch (R_i: layers full recompute runs again; extra: sp_extra with SP, selective_extra
                 or sp_selective_extra with selective recompute; full_extra is sp_full_extra with SP: the two
                 were measured together, their costs do not add)
      pipeline = (g + p - 1) x max_i stage_i
      fixed    = max_i (optimizer + L_i optimizer_per_layer + reduction_i) + engine
                 reduction_i = (reduce + L_i reduce_per_layer) x AR(dp c, P_i) / AR(world / tp, P_cal(L_i)):
                 gradients are reduced over DP x CP, measured over the calibration's (world / tp) on its own
                 model's parameters P_cal(L)
                 (`calibration_parameters(L)`), scaled by the all-reduce fit to this layout's DP and the stage's
                 parameters P_i (the fit alone where the calibration had one DP rank; 0 at DP 1)
      p2p      = 2 (g + p - 1) sends of a micro-batch's activations on a rank (b S / c tokens; / t with SP),
                 as the fitted model
      tied     = at PP > 1 the tied embedding's gradient all-reduce between the first and the last stage
    AR = the profile's all-reduce fit. The times were measured at ZeRO 0; at ZeRO 1 and 2 the optimizer part is
    divided by DP x CP (each rank updates its partition) and the reduction is RS(dp c, P_i) + AG(dp c, P_i) from the
    fits (reduce-scatter the gradients, all-gather the updated parameters); ZeRO 3 adds two all-gathers of the
    parameters per micro-batch (forward and backward) to the stage; offload adds 16 bytes x P_i / DP over the
    measured copy bandwidth. These ZeRO terms are the fits' prices, not measured engines. The times were measured
    with AdamW: --optimizer muon's step (`muon`) adds profile_muon_seconds to fixed. Under schedule dualpipev the
    stage lists are the pipeline ranks' (module docstring): the ends are rank 0's, and there is no tied term."""
    comm = profile.collective_seconds
    sp = sequence_parallel and tp > 1
    prefix = "sp_" if sp else ""
    extra = point.get(f"{prefix}selective_extra_s", 0.0) if selective else point.get("sp_extra_s", 0.0) if sp else 0.0
    again = point.get(f"{prefix}full_extra_s", 0.0)  # a recomputed layer's extra, SP's included
    reduced = dp * cp  # gradients are reduced, and ZeRO partitions, over DP x CP
    stages = []
    for i, (layers, redone) in enumerate(zip(stage_layers, recomputed_layers)):
        loss_rank = 0 if schedule == "dualpipev" else len(stage_layers) - 1
        ends = point["ends_s"] if i == loss_rank else 0.0
        gathers = 2 * comm("all_gather", reduced, stage_parameters[i] * bytes_per_value) if zero_stage == 3 else 0.0
        stages.append(layers * point["layer_s"] + (layers - redone) * extra + redone * again + ends
                      + point["engine_per_micro_s"] + gathers)
    calibration_dp = world // tp
    fixed = []
    for layers, params in zip(stage_layers, stage_parameters):
        optimizer = point["optimizer_s"] + layers * point["optimizer_per_layer_s"]
        nbytes = params * bytes_per_value
        if zero_stage:
            optimizer /= reduced
            reduction = comm("reduce_scatter", reduced, nbytes) + comm("all_gather", reduced, nbytes)
        else:
            wanted = comm("all_reduce", reduced, nbytes)
            measured_as = comm("all_reduce", calibration_dp, calibration_parameters(layers) * bytes_per_value)
            reduction = wanted if measured_as <= 0 else (
                (point["reduce_s"] + layers * point["reduce_per_layer_s"]) * wanted / measured_as)
        offload = 16.0 * params / reduced / (profile.memory_gbps * 1e9) if cpu_offload else 0.0
        fixed.append(optimizer + reduction + offload)
    step_fixed = max(fixed) + point["engine_s"] + profile_muon_seconds(profile, muon, tp)
    sent = micro * seq // cp * hidden * bytes_per_value / (tp if sp else 1)
    p2p = p2p_sends(schedule, gas, pp) * comm("send_recv", 2, sent) if pp > 1 else 0.0
    tied = comm("all_reduce", 2, tied_embedding_parameters * bytes_per_value) if pp > 1 and schedule != "dualpipev" \
        else 0.0
    pipeline = pipeline_periods(schedule, gas, pp) * max(stages)
    step = pipeline + step_fixed + p2p + tied
    return {"step_seconds": step, "pipeline_seconds": pipeline, "fixed_seconds": step_fixed,
            "p2p_seconds": p2p + tied, "offload_seconds": 0.0, "stage_seconds": max(stages)}
