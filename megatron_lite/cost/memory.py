"""Memory per rank, pipeline stage by pipeline stage, from the config alone.

Bytes on one rank of stage i at its peak = weights + gradients + optimizer
states (model states) + communication buffers + the largest of three phases:
  backward   activations (per micro-batch x micro-batches in flight) + the
             largest short-lived peak (the head's 16-bit logits and their
             gradient, the head weight's gradient before it is added to .grad, what
             recompute rebuilds at once, or with fewer key/value groups than
             TP ranks the gathered K/V weight rows);
  reduction  the gradient reduction's temporary copy (below);
  step       the optimizer's temporaries (cost/step_memory.py).
The activations are gone before the reduction starts.

Notation: P = this rank's parameters on the stage (after the TP split; cost/arithmetic.py
counts the GPT-2 and the Llama block alike), N = DP x CP (the ranks gradients are reduced and ZeRO
partitions over: `zero_partitions`; a CP rank holds the whole model), w = bytes of a weight (4 fp32,
2 bf16/fp16), e = bytes of an activation element (same as w), b = micro batch,
s = sequence, h = hidden, f = FFN width, a = heads, t = TP, V = padded vocabulary.

Model states (weights, gradients, optimizer states by precision, ZeRO stage, Muon and experts):
cost/model_state.py.

Communication buffers: DeepSpeedZeroOptimizer (ZeRO 1/2, and bf16/fp32 with
offload) allocates `reduce_bucket_size` elements (default 5e8) for gradient
reduction in its reduction dtype (fp32 at ZeRO 1, the weight dtype at ZeRO 2),
twice with `overlap_comm`, and once more at ZeRO 1 under the pipeline engine
(`reduce_gradients(pipeline_parallel=True)`); ZeRO 3 one bucket in the weights' dtype
(stage3.py's contiguous_gradients ipg buffer). Bucket sizes are read from the
DeepSpeed config our engine will pass (user JSON included).

Gradient reduction (DeepSpeed 0.19 engine.py `buffered_allreduce_fallback`, which the pipeline
engine runs at ZeRO 0 and under the bf16 optimizer, even at DP 1): it flattens the gradients into
buckets of up to 5e8 elements and all-reduces each: a copy of min(P, 5e8) gradients (fp32 under the
bf16 optimizer, whose gradients are its fp32 accumulators; measured on this engine). ZeRO 1/2's own
buckets are the communication buffers above. With experts the dense gradients are reduced first, then
the experts' over expert-DP (engine.py `_reduce_expert_gradients`): the larger of the two copies (not
measured).
Gradients during a step (`step_gradient_bytes`): at ZeRO 0 and 1 every parameter's own .grad, in the
weights' dtype, from the first backward to the end of the optimizer step, and not between steps.
Optimizer step: its temporaries (AdamW's, DeepSpeedZeroOptimizer's, Muon's): cost/step_memory.py.

Pipeline engine buffers (PP > 1), activation-sized (e bsh each, s = S / CP this rank's part of
the sequence; e bsh / TP with sequence parallelism) and kept between steps, counted tensor by tensor
on this engine (DeepSpeed 0.19.8, gas 4: TP 1/2/4 x PP 2, TP 1 x PP 4, TP 2 x PP 3): every stage but
the first keeps its receive buffer, the first its gradient-receive buffer, and the last stage two
more whole activations (found among the live tensors, not reachable by name from the engine's
attributes). At TP > 1 without sequence parallelism
DeepSpeed partitions what it sends (pipe_partitioned, grad_partitioned: each rank sends 1/TP and
the receiver gathers), so the receive and gradient-receive buffers are 1/TP of an activation while
the last stage's two stay whole. This replaced a booking of 2 x num_pipe_buffers + 3
activations on later stages (7 at PP 2) that the census measured high: 3.1 / 3.6 / 3.9 activations
too many at TP 1 / 2 / 4 (between steps 0.94 / 0.87 / 0.79 of the estimate, fp32 ZeRO 0 PP 2).
The last stage's outputs (its [b, s, V/t] logits) would stay in the engine's pipe buffers after
backward (DeepSpeed 0.19 clears them on the other stages only): deepspeed_compat frees them
(`free_last_stage_outputs_after_backward`), so they are not counted.

Activations: what autograd keeps per micro-batch, per layer and stage, with sequence
parallelism, context parallelism and selective / full / partial recompute: cost/activations.py.

Micro-batches in flight under DeepSpeed's 1F1B (pipe/schedule.py
TrainSchedule.num_pipe_buffers): stage i holds min(gas, PP - i); the ZeRO 2/3
engine (PP = 1) runs one micro-batch at a time. Tied embedding and head are
two full copies at PP > 1 (first and last stage) and one module at PP = 1; Multi-Token Prediction's
tied embedding is that module again on the last stage (stages.stage_module_tensors).

--pipeline-schedule dualpipev (2 PP stages, rank r holding r and 2 PP - 1 - r): one StageMemory per pipeline
rank, its two stages' parameters together (rank 0's embedding and head one module) and their activations
together: at a rank's peak stage s of 2 PP holds 2 PP - s micro-batches, both of the rank's stages at once (r's
2 PP - r and 2 PP - 1 - r's r + 1: DeepSpeed's DualPipeVSchedule, replayed in tests/test_deepspeed_compat.py),
so each rank holds about rank 0's 1F1B activations. DualPipeVEngine frees every stage's outputs after backward
and keeps one activation-sized buffer between steps (the one `_recv_tensor_meta` allocates); not measured with
the census.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from megatron_lite.config import Config
from megatron_lite.cost import activations
from megatron_lite.cost.arithmetic import embedding_tensors
from megatron_lite.cost.model_state import (
    DEFAULT_PERSISTENCE,
    fp32_accumulation,
    muon_parameters,
    stage_model_state_bytes,
    uses_zero_optimizer,
    zero3_gathered_bytes,
    zero3_persistent_parameters,
    zero_partitions,
)
from megatron_lite.cost.mtp_activations import mtp_activation_bytes
from megatron_lite.cost.stages import (
    per_rank,
    rank_module_tensors,
    rank_parameters,
    stage_bounds,
    stage_expert_parameters,
    stage_layer_numbers,
    stage_matrices,
    stage_mtp_layer_numbers,
)
from megatron_lite.cost.step_memory import step_transient_bytes
from megatron_lite.deepspeed_config import sends_partitioned
from megatron_lite.model.virtual_stages import rank_stages, stage_count

GIB = 1024 ** 3
DEFAULT_BUCKET = int(5e8)


@dataclass(frozen=True)
class StageMemory:
    stage: int
    transformer_layers: int
    parameters: int
    """This rank's parameters on the stage (after the TP split)."""
    weights: int
    gradients: int
    optimizer_states: int
    communication_buffers: int
    activations_per_micro_batch: int
    micro_batches_in_flight: int
    activations: int
    transient: int
    """Largest short-lived peak on top of the activations (head logits and cross entropy, or what
    recompute rebuilds at once)."""
    reduction_transient: int
    """The gradient reduction's temporary copy (after the activations are freed)."""
    step_transient: int
    """The optimizer step's temporaries."""
    cpu_bytes: int
    """What optimizer offload keeps in CPU memory for this rank."""
    snapshot: int = 0
    """--async-save: the host copy of what this rank's save writes (weights and optimizer states), held from
    the save step until its files are written, over the steps that run meanwhile."""
    snapshot_in_peak: bool = False
    """Whether the snapshot shares memory with training (a CPU run), so it counts in the peak."""
    step_gradients: int = 0
    """The parameters' own .grad tensors, alive from a step's first backward through its optimizer step and
    freed after it (so not between steps): at ZeRO 0 and 1 every parameter's, in the weights' dtype
    (`step_gradient_bytes`)."""
    gathered: int = 0
    """ZeRO 3 during forward and backward: the gathered parameters and the largest tensor's full gradient
    before its reduction (`zero3_gathered_bytes`)."""

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.optimizer_states

    @property
    def peak(self) -> int:
        phases = (self.activations + self.transient + self.gathered, self.reduction_transient, self.step_transient)
        return (self.model_states + self.communication_buffers + self.step_gradients + max(phases)
                + (self.snapshot if self.snapshot_in_peak else 0))

    @property
    def between_steps(self) -> int:
        """What stays allocated between steps: model states and communication (and pipe) buffers."""
        return self.model_states + self.communication_buffers

    def to_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), model_states=self.model_states, peak=self.peak, between_steps=self.between_steps)


def _zero_settings(ds_config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    zero = dict((ds_config or {}).get("zero_optimization", {}))
    stage = int(zero.get("stage", 0))
    overlap = zero.get("overlap_comm")
    return {
        "reduce_bucket_size": int(float(zero.get("reduce_bucket_size", DEFAULT_BUCKET))),
        "overlap_comm": bool(overlap) if overlap is not None else stage == 3,
        "offload_param": (zero.get("offload_param") or {}).get("device", "none") == "cpu",
        "persistence_threshold": int(float(zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE))),
    }


def communication_bytes(config: Config, ds_config: Optional[Dict[str, Any]]) -> int:
    zero, precision = config.parallel.zero_stage, config.precision.dtype_name
    settings = _zero_settings(ds_config)
    if zero == 3:  # one contiguous_gradients bucket in the weights' dtype (stage3.py ipg_buckets)
        return settings["reduce_bucket_size"] * (4 if precision == "fp32" or fp32_accumulation(config) else 2)
    if not uses_zero_optimizer(zero, precision, config.parallel.cpu_offload, fp32_accumulation(config)):
        return 0
    dtype_bytes = 4 if (zero == 1 or precision == "fp32") else 2
    buffers = (2 if settings["overlap_comm"] else 1) + (1 if zero == 1 else 0)
    return buffers * settings["reduce_bucket_size"] * dtype_bytes


def reduction_transient_bytes(parameters: int, zero_stage: int, precision: str, cpu_offload: bool,
                              fp32_accumulation: bool = True, expert_parameters: int = 0) -> int:
    """The gradient reduction's temporary flat copy (see above); ZeRO 1/2 buckets are communication buffers.
    expert_parameters: the part of `parameters` reduced after the rest, over expert-DP."""
    if uses_zero_optimizer(zero_stage, precision, cpu_offload, fp32_accumulation) or zero_stage >= 2:
        return 0
    # fp32: ZeRO 0 fp32, or the bf16 optimizer's fp32 gradients
    return 4 * max(min(parameters - expert_parameters, DEFAULT_BUCKET), min(expert_parameters, DEFAULT_BUCKET))


def step_gradient_bytes(parameters: int, zero_stage: int, precision: str, partitions: int = 1,
                        cpu_offload: bool = False) -> int:
    """The parameters' own gradients during a step (StageMemory.step_gradients). Measured with
    benchmarks/memory_census.py (bytes alive at each pipeline instruction, P = the stage's parameters):
    from the first micro-batch's backward to the end of the optimizer step every rank holds w P more
    than between steps at ZeRO 0 (fp32: torch's .grad, freed by zero_grad; bf16: BF16_Optimizer's
    bf16 .grad besides its flat accumulators) and at ZeRO 1 (DeepSpeedZeroOptimizer under the pipeline
    engine keeps full gradients until its end-of-step reduction; BF16_Optimizer as at ZeRO 0); at ZeRO 2
    the rank's 16-bit gradient partition, 2P/N, and in fp32 runs (which keep a 4P/N partition between
    steps too, a model state) 8P/N more at the backward's peak: measured at DP 1 and 2 (4P/N through the
    forward passes), not traced to the allocations that make it. ZeRO 3 books its gradient shard as a
    model state."""
    if zero_stage >= 3 or (zero_stage == 2 and cpu_offload):  # ZeRO-Offload moves the partition to the CPU
        return 0
    if zero_stage == 2:
        return (8 if precision == "fp32" else 2) * parameters // partitions
    return (4 if precision == "fp32" else 2) * parameters


def pipeline_buffer_bytes(stage: int, pp: int, boundary: int, partitions: int, schedule: str = "1f1b") -> int:
    """Bytes of the pipeline engine's buffers kept between steps on a stage (see above): `boundary` is an
    activation's bytes, `partitions` the TP degree DeepSpeed cuts its sends into (1 when it sends whole)."""
    if pp == 1:
        return 0
    if schedule == "dualpipev":
        return boundary
    receive = boundary // partitions
    return receive + (2 * boundary if stage == pp - 1 else 0)


def pipe_partitions(config: Config) -> int:
    """The parts DeepSpeed cuts an activation into for a send between stages (deepspeed_config.sends_partitioned)."""
    return config.parallel.tensor_model_parallel_size if sends_partitioned(config) else 1


def head_gradient_bytes(config: Config) -> int:
    """The gradient of the head's weight [V/t, h] (in the weights' dtype) that autograd makes in backward
    before adding it to .grad: part of the last stage's short-lived peak at ZeRO 0/1. Traced tensor by tensor
    (benchmarks/memory_census.py, PP 2, fp32): at that stage's peak it was the one storage not booked (1 MB at
    TP 1, 0.5 at TP 2, 0.25 at TP 4, vocabulary 2048 x hidden 128), once the pipe buffers were no longer booked
    3-4 activations too high; at PP 1 the ZeRO 0/1 peaks went from 1.04-1.07 to 1.02-1.03 of the estimate.
    None at ZeRO 2/3, whose bookings already hold it (ZeRO 2's gradients during backward, ZeRO 3's gathered
    working set: the largest tensor's full gradient); added there too, their peaks measured 0.93-0.98 where
    they had been 0.97-1.02."""
    if config.parallel.zero_stage >= 2:
        return 0
    weight_bytes = 4 if config.precision.dtype_name == "fp32" else 2
    return weight_bytes * embedding_tensors(config.model, config.parallel.tensor_model_parallel_size)[0]


def micro_batches_in_flight(config: Config, stage: int) -> int:
    """At the peak, on stage `stage` (of 2 PP under dualpipev): min(gas, stages - stage)."""
    pp, gas = config.parallel.pipeline_model_parallel_size, config.batch.gradient_accumulation_steps
    if config.parallel.zero_stage >= 2:
        return 1
    return max(1, min(gas, stage_count(pp, config.parallel.pipeline_schedule) - stage))


def estimate(config: Config, ds_config: Optional[Dict[str, Any]], device: str = "cuda") -> List[StageMemory]:
    """One StageMemory per pipeline stage (per pipeline rank: two stages under dualpipev) for a validated config
    (vocabulary padded).

    ds_config: the DeepSpeed dict the engine gets (deepspeed_config.py `deepspeed_config(config)`;
    its zero_optimization settings size the buffers). device: "cuda" or "cpu" (only the dropout masks differ).
    `profile` stage splits are estimated with the FLOP cost split (the timings exist only once running).
    """
    par = config.parallel
    precision = config.precision.dtype_name
    bounds = stage_bounds(config, estimate=True)
    # Per pipeline rank: its stage, or under dualpipev its two stages together.
    params = rank_parameters(config, bounds)
    experts = per_rank(config, stage_expert_parameters(config, bounds))
    matrices = per_rank(config, stage_matrices(config, bounds), combine=lambda parts: [x for p in parts for x in p])
    rank_modules = rank_module_tensors(config, bounds)
    settings = _zero_settings(ds_config)
    comm = communication_bytes(config, ds_config)
    pp, schedule, count = par.pipeline_model_parallel_size, par.pipeline_schedule, len(bounds) - 1
    layer_numbers, depths = stage_layer_numbers(config, bounds), stage_mtp_layer_numbers(config, bounds)
    boundary = activations.stage_output_bytes(config)  # [b, S/CP, h] or its sequence-parallel shard
    stages = []
    for i in range(pp):
        here = rank_stages(pp, schedule, i)
        layers, last = sum(len(layer_numbers[s]) for s in here), count - 1 in here
        modules = rank_modules[i]  # one per spec, the embedding's once however many tied specs use it
        threshold = settings["persistence_threshold"]
        persistent = zero3_persistent_parameters([n for module in modules for n in module], threshold)
        states = stage_model_state_bytes(config, params[i], experts[i], par.cpu_offload, settings["offload_param"],
                                         persistent, muon_parameters(config, matrices[i]))
        per_mb, held, inflight, rebuilt = 0, 0, 0, 0
        for s in here:
            stage_mb, stage_rebuilt = activations.stage_layer_bytes(config, len(layer_numbers[s]), device,
                                                                    layer_numbers[s].start)
            if bounds[s] == 0:
                stage_mb += activations.embedding_activation_bytes(config, device)
            if depths[s]:
                stage_mb += mtp_activation_bytes(config, device)
            if s == count - 1:
                stage_mb += activations.head_activation_bytes(config, device)
            else:
                stage_mb += boundary  # this stage's output, kept for the send
            per_mb, held = per_mb + stage_mb, held + stage_mb * micro_batches_in_flight(config, s)
            inflight, rebuilt = inflight + micro_batches_in_flight(config, s), max(rebuilt, stage_rebuilt)
        stages.append(StageMemory(
            stage=i, transformer_layers=layers, parameters=params[i], weights=states["weights"],
            gradients=states["gradients"], optimizer_states=states["optimizer_states"],
            communication_buffers=comm + pipeline_buffer_bytes(i, pp, boundary, pipe_partitions(config), schedule),
            activations_per_micro_batch=per_mb, micro_batches_in_flight=inflight,
            activations=held,
            # The head's weight gradient comes once the 16-bit logits and their gradient are gone (measured).
            transient=max(activations.head_transient_bytes(config) if last else 0,
                          head_gradient_bytes(config) if last else 0, rebuilt,
                          activations.kv_gather_transient_bytes(config) if layers else 0),
            reduction_transient=reduction_transient_bytes(params[i], par.zero_stage, precision, par.cpu_offload,
                                                          fp32_accumulation(config), experts[i]),
            step_transient=step_transient_bytes(config, params[i], device, experts[i], matrices[i]),
            cpu_bytes=states["cpu_bytes"],
            snapshot=states["saved"] if config.training.async_save else 0, snapshot_in_peak=device == "cpu",
            step_gradients=step_gradient_bytes(params[i], par.zero_stage, precision, zero_partitions(config),
                                               par.cpu_offload),
            gathered=(zero3_gathered_bytes(modules, precision, zero_partitions(config), threshold)
                      if par.zero_stage == 3 else 0),
        ))
    return stages


def estimate_peak_bytes(config: Config, stage: int, ds_config: Optional[Dict[str, Any]],
                        device: Optional[str] = None) -> int:
    """Predicted peak bytes of one rank of pipeline stage `stage`: what training logs next to the
    measured peak. device defaults to where this process runs (cuda if available, else cpu)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return estimate(config, ds_config, device)[stage].peak


def format_table(stages: List[StageMemory], gpu_memory_bytes: Optional[int] = None) -> str:
    """A table per stage in GiB, and the peak: weights + grads + optim + comm stay between steps; step grads
    during a step; then the largest of acts + transient, reduce and step."""
    cols = [("weights", "weights"), ("grads", "gradients"), ("optim", "optimizer_states"),
            ("comm", "communication_buffers"), ("step grads", "step_gradients"), ("gathered", "gathered"),
            ("act/mb", "activations_per_micro_batch"),
            ("in flight", "micro_batches_in_flight"), ("acts", "activations"), ("transient", "transient"),
            ("reduce", "reduction_transient"), ("step", "step_transient"), ("cpu", "cpu_bytes"), ("peak", "peak")]
    lines = [f"{'stage':>5} {'layers':>6} {'params':>14} " + " ".join(f"{c:>10}" for c, _ in cols)]
    for st in stages:
        d = st.to_dict()
        cells = [f"{d[k]:>10d}" if k == "micro_batches_in_flight" else f"{d[k] / GIB:>10.3f}" for _, k in cols]
        lines.append(f"{st.stage:>5} {st.transformer_layers:>6} {st.parameters:>14,} " + " ".join(cells))
    worst = max(stages, key=lambda st: st.peak)
    summary = f"peak {worst.peak / GIB:.3f} GiB per rank on stage {worst.stage} (GiB = 2^30 bytes)"
    if gpu_memory_bytes:
        summary += f"; {'fits' if worst.peak <= gpu_memory_bytes else 'does NOT fit'} in {gpu_memory_bytes / GIB:.1f} GiB"
    largest = max(stages, key=lambda st: st.snapshot)
    if largest.snapshot:
        summary += (f"\n--async-save: a snapshot of up to {largest.snapshot / GIB:.3f} GiB per rank in host memory while a "
                    f"checkpoint is written" + (" (in the peak above)" if largest.snapshot_in_peak else ""))
    return "\n".join(lines + [summary])

