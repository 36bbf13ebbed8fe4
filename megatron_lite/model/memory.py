"""Memory per rank, pipeline stage by pipeline stage, from the config alone.

Bytes on one rank of stage i = weights + gradients + optimizer states
(model states, held at the optimizer step) + communication buffers
+ activations (per micro-batch x micro-batches in flight) + the largest
short-lived peak (head logits / cross entropy, or one recomputed layer).

Notation: P = this rank's parameters on the stage (after the TP split), N = DP,
w = bytes of a weight (4 fp32, 2 bf16/fp16), e = bytes of an activation element
(same as w), b = micro batch, s = sequence, h = hidden, f = FFN width,
a = heads, t = TP, V = padded vocabulary.

Model states follow the optimizer DeepSpeed 0.19 builds for our engine
(runtime/engine.py `_do_optimizer_sanity_check`, bf16_optimizer.py,
fp16/fused_optimizer.py, zero/stage_1_and_2.py, zero/stage3.py):

  precision ZeRO  path                     weights     gradients       optimizer
  fp32      0     torch AdamW              4P          4P              8P (moments)
  fp32      1,2   DeepSpeedZeroOptimizer   4P          4P/N            8P/N (1)
  bf16      0     BF16_Optimizer           2P          2P (bf16 acc.)  12P/N (master + moments over DP)
  bf16      1     BF16_Optimizer           2P          4P (fp32 acc.)  12P/N
  fp16      0     FP16_Optimizer           2P          2P + 4P         12P (fp32 master + moments)
  16-bit    1,2   DeepSpeedZeroOptimizer   2P          6P/N            12P/N   (= DeepSpeed's 2P + 18P/N)
  any       3     DeepSpeedZeRoOffload     w P/N + 2wL 4P/N            12P/N   (= DeepSpeed's 4L + 18P/N)
  + optimizer offload (ZeRO >= 1): gradients and optimizer states of the
    partition live in CPU memory (reported as cpu bytes); with ZeRO 3 and
    parameter offload the device keeps only the 2wL working set.
  (1) measured on this engine: at the step three partition-sized fp32 tensors
      are resident besides the flat weights (4P + 12P/N); the table books them
      as gradient + two moments.
  L = the largest layer's parameters (the gathered working set of ZeRO 3).

Communication buffers: DeepSpeedZeroOptimizer (ZeRO 1/2, and bf16/fp32 with
offload) allocates `reduce_bucket_size` elements (default 5e8) for gradient
reduction in its reduction dtype (fp32 at ZeRO 1, the weight dtype at ZeRO 2),
twice with `overlap_comm`, and once more at ZeRO 1 under the pipeline engine
(`reduce_gradients(pipeline_parallel=True)`). Bucket sizes are read from the
DeepSpeed config our engine will pass (user JSON included).

Pipeline engine buffers (PP > 1), activation-sized (e bsh each) and kept
between steps: a later stage keeps its received inputs and their gradients
for num_pipe_buffers = max(2, min(PP - i, gas)) slots plus 3 more (receive
and gradient buffers); the first stage keeps 1 (its send buffer). Counted on
this engine with DeepSpeed 0.19.8 at PP 2, gas 4: 1 on stage 0, 7 on stage 1.

Activations saved for backward, per micro-batch and transformer layer, for
our layer (model/transformer.py; what each autograd node keeps, storages
counted once):
  2 LayerNorm inputs + 2 LayerNorm outputs       4 e bsh
  QKV output (q, k, v are views of it)           3 e bsh / t
  attention context (before the projection)      e bsh / t
  MLP input of GELU and GELU output              2 e bsf / t
  fused softmax keeps its output only            e a s^2 b / t
  attention dropout (p > 0): mask + output       (k + e) a s^2 b / t
  (--attention-backend sdpa instead: its flash kernels keep the fp32 log-sum-exp,
  4 a s b / t, and no s^2 term; on CPU, SDPA with dropout takes torch's math path,
  which keeps what the fused path keeps - both measured on CPU)
  two hidden dropouts (p > 0): masks             2 k bsh
  (k = bytes of a dropout mask: 1 on CUDA, where native_dropout keeps a bool
  mask; e on CPU, where dropout keeps a mask in the input's dtype - measured)
  LayerNorm mean and rstd (fp32)                 16 bs
  => Korthikanti et al. 2022's s b h (34 + 5 a s / h) at t = 1, e = 2, f = 4h,
     up to the LayerNorm statistics.
  With --recompute-activations a layer keeps only its input (e bsh), and
  backward rebuilds one layer's activations at a time (a transient).
First stage adds the embedding: token and position ids (8 bs each), the
out-of-range mask at t > 1 (bs), the dropout mask (k bsh). Last stage adds the
final LayerNorm input (e bsh + 8 bs), the head input (e bsh) and the vocab-parallel
cross entropy's saved fp32 softmax (4 bsV/t) with its targets (9 bs). The cross
entropy works in place on fp32 logits, so the softmax is the logits' own buffer.
16-bit logits live on while their fp32 copy is made, and backward turns the fp32
gradient into a 16-bit one: a transient of e bsV/t when e < 4, none at fp32.
A non-last stage also keeps its output (e bsh) per micro-batch in flight for
the send.

Micro-batches in flight under DeepSpeed's 1F1B (pipe/schedule.py
TrainSchedule.num_pipe_buffers): stage i holds min(gas, PP - i); the ZeRO 2/3
engine (PP = 1) runs one micro-batch at a time. Tied embedding and head are
two full copies at PP > 1 (first and last stage) and one module at PP = 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from megatron_lite.config import Config
from megatron_lite.model.arithmetic import spec_parameters, stage_bounds, stage_parameters, transformer_layers_per_stage
from megatron_lite.model.transformer import resolve_attention_backend

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
    """Largest short-lived peak on top of the rest (head logits and cross entropy, or a recomputed layer)."""
    cpu_bytes: int
    """What optimizer offload keeps in CPU memory for this rank."""

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.optimizer_states

    @property
    def peak(self) -> int:
        return self.model_states + self.communication_buffers + self.activations + self.transient

    def to_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), model_states=self.model_states, peak=self.peak)


def _zero_settings(ds_config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    zero = dict((ds_config or {}).get("zero_optimization", {}))
    stage = int(zero.get("stage", 0))
    overlap = zero.get("overlap_comm")
    return {
        "reduce_bucket_size": int(float(zero.get("reduce_bucket_size", DEFAULT_BUCKET))),
        "overlap_comm": bool(overlap) if overlap is not None else stage == 3,
        "offload_param": (zero.get("offload_param") or {}).get("device", "none") == "cpu",
    }


def model_state_bytes(parameters: int, zero_stage: int, data_parallel_size: int, precision: str,
                      cpu_offload: bool = False, offload_param: bool = False,
                      largest_layer_parameters: int = 0) -> Dict[str, int]:
    """weights / gradients / optimizer_states on the device and cpu_bytes, per rank (see the table above)."""
    p, n = parameters, data_parallel_size
    w = 4 if precision == "fp32" else 2
    shard = lambda bytes_per_param: int(bytes_per_param * p / n)  # noqa: E731
    if zero_stage == 3:
        weights = (0 if offload_param else shard(w)) + 2 * w * largest_layer_parameters
        grads, optim = shard(4), shard(12 if precision != "fp32" else 8)
    elif zero_stage == 0 and precision == "fp32":
        weights, grads, optim = 4 * p, 4 * p, 8 * p
    elif zero_stage == 0 and precision == "bf16":
        weights, grads, optim = 2 * p, 2 * p, shard(12)
    elif zero_stage == 0:  # fp16
        weights, grads, optim = 2 * p, 6 * p, 12 * p
    elif zero_stage == 1 and precision == "bf16" and not cpu_offload:
        weights, grads, optim = 2 * p, 4 * p, shard(12)
    elif precision == "fp32":
        weights, grads, optim = 4 * p, shard(4), shard(8)
    else:
        weights, grads, optim = 2 * p, shard(6), shard(12)
    cpu = 0
    if cpu_offload and zero_stage >= 1:
        cpu = shard(4) + (shard(12) if precision != "fp32" else shard(8))
        if offload_param and zero_stage == 3:
            cpu += shard(w)
        grads, optim = 0, 0
    return {"weights": weights, "gradients": grads, "optimizer_states": optim, "cpu_bytes": cpu}


def _uses_zero_optimizer(zero_stage: int, precision: str, cpu_offload: bool) -> bool:
    """Whether DeepSpeedZeroOptimizer (with its gradient buckets) runs, rather than BF16/FP16_Optimizer or torch's."""
    if zero_stage in (1, 2):
        return not (zero_stage == 1 and precision == "bf16" and not cpu_offload)
    return False


def communication_bytes(config: Config, ds_config: Optional[Dict[str, Any]]) -> int:
    zero, precision = config.parallel.zero_stage, config.precision.dtype_name
    settings = _zero_settings(ds_config)
    if not _uses_zero_optimizer(zero, precision, config.parallel.cpu_offload):
        return 0
    dtype_bytes = 4 if (zero == 1 or precision == "fp32") else 2
    buffers = (2 if settings["overlap_comm"] else 1) + (1 if zero == 1 else 0)
    return buffers * settings["reduce_bucket_size"] * dtype_bytes


def _mask_bytes(config: Config, device: str) -> int:
    return 1 if device == "cuda" else (4 if config.precision.dtype_name == "fp32" else 2)


def layer_activation_bytes(config: Config, device: str = "cuda") -> int:
    """Bytes one transformer layer saves for backward for one micro-batch (recompute off)."""
    m = config.model
    t, b = config.parallel.tensor_model_parallel_size, config.batch.micro_batch_size
    s, h, f, a = m.seq_length, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    e = 4 if config.precision.dtype_name == "fp32" else 2
    bsh = b * s * h
    scores = a * s * s * b // t
    total = 4 * e * bsh + 4 * e * bsh // t + 2 * e * b * s * f // t + 16 * b * s
    flash = resolve_attention_backend(m.attention_backend, device) == "sdpa" and (
        device == "cuda" or m.attention_dropout == 0)
    if flash:
        total += 4 * scores // s  # SDPA's flash kernels keep the fp32 log-sum-exp per query, not the scores
    else:
        total += e * scores
        if m.attention_dropout > 0:
            total += (_mask_bytes(config, device) + e) * scores
    if m.hidden_dropout > 0:
        total += 2 * _mask_bytes(config, device) * bsh
    return total


def _embedding_activation_bytes(config: Config, device: str) -> int:
    m, t, b = config.model, config.parallel.tensor_model_parallel_size, config.batch.micro_batch_size
    bs = b * m.seq_length
    total = 8 * bs + (8 * bs if m.position_embedding_type == "learned_absolute" else 0) + (bs if t > 1 else 0)
    return total + (_mask_bytes(config, device) * bs * m.hidden_size if m.hidden_dropout > 0 else 0)


def _head_activation_bytes(config: Config) -> int:
    m, t, b = config.model, config.parallel.tensor_model_parallel_size, config.batch.micro_batch_size
    e = 4 if config.precision.dtype_name == "fp32" else 2
    bs = b * m.seq_length
    return 2 * e * bs * m.hidden_size + 8 * bs + 4 * bs * m.padded_vocab_size // t + 9 * bs + 8 * bs


def _head_transient_bytes(config: Config) -> int:
    m, t, b = config.model, config.parallel.tensor_model_parallel_size, config.batch.micro_batch_size
    e = 4 if config.precision.dtype_name == "fp32" else 2
    return (e if e < 4 else 0) * b * m.seq_length * m.padded_vocab_size // t


def pipeline_buffer_count(stage: int, pp: int, gas: int) -> int:
    """Activation-sized buffers the pipeline engine keeps between steps on a stage (see above)."""
    if pp == 1:
        return 0
    return 1 if stage == 0 else 2 * max(2, min(pp - stage, gas)) + 3


def micro_batches_in_flight(config: Config, stage: int) -> int:
    pp, gas = config.parallel.pipeline_model_parallel_size, config.batch.gradient_accumulation_steps
    if config.parallel.zero_stage >= 2:
        return 1
    return max(1, min(gas, pp - stage))


def estimate(config: Config, ds_config: Optional[Dict[str, Any]], device: str = "cuda") -> List[StageMemory]:
    """One StageMemory per pipeline stage for a validated config (vocabulary padded).

    ds_config: the DeepSpeed dict the engine gets (training/deepspeed_config.py `deepspeed_config(config)`;
    its zero_optimization settings size the buffers). device: "cuda" or "cpu" (only the dropout masks differ).
    `profile` stage splits are estimated with the FLOP cost split (the timings exist only once running).
    """
    par, m = config.parallel, config.model
    precision = config.precision.dtype_name
    e = 4 if precision == "fp32" else 2
    bsh = config.batch.micro_batch_size * m.seq_length * m.hidden_size
    bounds = stage_bounds(config, estimate=True)
    params = stage_parameters(config, bounds)
    per_spec = spec_parameters(config)
    largest = max(per_spec)
    settings = _zero_settings(ds_config)
    comm = communication_bytes(config, ds_config)
    pp, gas = par.pipeline_model_parallel_size, config.batch.gradient_accumulation_steps
    num_specs = len(per_spec)
    layers_per_stage = transformer_layers_per_stage(config, bounds)
    stages = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        layers = layers_per_stage[i]
        states = model_state_bytes(params[i], par.zero_stage, par.data_parallel_size, precision, par.cpu_offload,
                                   settings["offload_param"], largest)
        per_layer = e * bsh if m.recompute_activations else layer_activation_bytes(config, device)
        per_mb = layers * per_layer
        if a == 0:
            per_mb += _embedding_activation_bytes(config, device)
        last = b == num_specs
        if last:
            per_mb += _head_activation_bytes(config)
        else:
            per_mb += e * bsh  # this stage's output, kept for the send
        inflight = micro_batches_in_flight(config, i)
        transient = max(_head_transient_bytes(config) if last else 0,
                        layer_activation_bytes(config, device) if m.recompute_activations else 0)
        stages.append(StageMemory(
            stage=i, transformer_layers=layers, parameters=params[i], weights=states["weights"],
            gradients=states["gradients"], optimizer_states=states["optimizer_states"],
            communication_buffers=comm + pipeline_buffer_count(i, pp, gas) * e * bsh,
            activations_per_micro_batch=per_mb, micro_batches_in_flight=inflight,
            activations=per_mb * inflight, transient=transient, cpu_bytes=states["cpu_bytes"],
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
    """A table per stage in GiB, and the peak."""
    cols = [("weights", "weights"), ("grads", "gradients"), ("optim", "optimizer_states"),
            ("comm", "communication_buffers"), ("act/mb", "activations_per_micro_batch"),
            ("in flight", "micro_batches_in_flight"), ("acts", "activations"), ("transient", "transient"),
            ("cpu", "cpu_bytes"), ("peak", "peak")]
    lines = [f"{'stage':>5} {'layers':>6} {'params':>14} " + " ".join(f"{c:>9}" for c, _ in cols)]
    for st in stages:
        d = st.to_dict()
        cells = [f"{d[k]:>9d}" if k == "micro_batches_in_flight" else f"{d[k] / GIB:>9.3f}" for _, k in cols]
        lines.append(f"{st.stage:>5} {st.transformer_layers:>6} {st.parameters:>14,} " + " ".join(cells))
    worst = max(stages, key=lambda st: st.peak)
    summary = f"peak {worst.peak / GIB:.3f} GiB per rank on stage {worst.stage} (GiB = 2^30 bytes)"
    if gpu_memory_bytes:
        summary += f"; {'fits' if worst.peak <= gpu_memory_bytes else 'does NOT fit'} in {gpu_memory_bytes / GIB:.1f} GiB"
    return "\n".join(lines + [summary])
