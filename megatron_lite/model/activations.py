"""Bytes autograd keeps for backward for one micro-batch: per transformer layer, embedding and head.

What each autograd node of our layer keeps (model/transformer.py; storages counted once), with
e = bytes of an activation element (4 fp32, 2 bf16/fp16), k = bytes of a dropout mask element
(1 on CUDA, where native_dropout keeps a bool mask; e on CPU, where dropout keeps a mask in the
input's dtype: measured), t = TP, r = t with --sequence-parallel and 1 without (what divides the
residual stream), b = micro batch, s = sequence, h = hidden, f = FFN width, a = heads:

  2 LayerNorm inputs + 2 LayerNorm outputs       4 e bsh / r   (sequence parallel: shards; the
                                                               column-parallel linears keep the shard
                                                               and all-gather it again in backward)
  LayerNorm mean and rstd (fp32)                 16 bs / r
  QKV output (q, k, v are views of it)           3 e bsh / t
  attention context (the projection's input)     e bsh / t
  MLP: input of GELU and GELU output             2 e bsf / t
  attention core:
    the fused softmax keeps its output only      e a s^2 b / t
    attention dropout (p > 0): mask + output     (k + e) a s^2 b / t
    (--attention-backend sdpa instead: its flash kernels keep the fp32 log-sum-exp, 4 a s b / t,
    and no s^2 term; on CPU, SDPA with dropout takes torch's math path, which keeps what the
    fused path keeps - both measured)
  two hidden dropouts (p > 0): masks             2 k bsh / r
  => Korthikanti et al. 2022, for e = 2, k = 1, f = 4h (LayerNorm statistics left out):
     sbh(34 + 5as/h) at t = 1, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34/t + 5as/(ht)) with TP + SP.

--recompute-granularity selective drops the attention core's terms: its checkpoint keeps q, k, v
(the QKV output, counted above), and its output is the projection's input (counted above); so
sbh 34/t with TP + SP. Under flash SDPA there is no s^2 term to drop: selective saves the
log-sum-exp only, and still runs the attention core twice. Backward rebuilds one layer's
attention core at a time (a transient).
--recompute-granularity full keeps each recomputed chunk's input (e bsh / r) instead of its layers'
activations (model/arithmetic.py `recompute_chunks`); backward rebuilds one chunk at a time: up to N
layers' activations with --recompute-method uniform, one layer with block.

First stage adds the embedding: token and position ids (8 bs each), the out-of-range mask at t > 1
(bs), the dropout mask (k bsh / r). Last stage adds the final LayerNorm input (e bsh / r + 8 bs / r
statistics), the head input (e bsh / r: the gathered sequence is not kept), the vocab-parallel cross
entropy's saved fp32 softmax (4 bsV/t) and its targets (17 bs). The cross entropy works in place on
fp32 logits, so the softmax is the logits' own buffer. 16-bit logits live on while their fp32 copy
is made, and backward turns the fp32 gradient into a 16-bit one: a transient of e bsV/t when e < 4.
A non-last stage also keeps its output (e bsh / r) per micro-batch in flight for the send.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from megatron_lite.config import Config
from megatron_lite.model.arithmetic import recompute_chunks
from megatron_lite.model.transformer import resolve_attention_backend


@dataclass(frozen=True)
class Dims:
    e: int
    k: int
    t: int
    r: int
    b: int
    s: int
    h: int
    f: int
    a: int

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h


def dims(config: Config, device: str) -> Dims:
    m, p = config.model, config.parallel
    e = 4 if config.precision.dtype_name == "fp32" else 2
    t = p.tensor_model_parallel_size
    return Dims(e=e, k=1 if device == "cuda" else e, t=t, r=t if p.sequence_parallel else 1,
                b=config.batch.micro_batch_size, s=m.seq_length, h=m.hidden_size, f=m.ffn_hidden_size,
                a=m.num_attention_heads)


def flash_attention(config: Config, device: str) -> bool:
    """Whether SDPA runs a kernel that keeps no s x s tensor (on CPU only without attention dropout)."""
    m = config.model
    return resolve_attention_backend(m.attention_backend, device) == "sdpa" and (
        device == "cuda" or m.attention_dropout == 0)


def attention_core_bytes(config: Config, device: str = "cuda") -> int:
    """What the attention core (scores, softmax, dropout, x V) keeps: selective recompute's saving."""
    d = dims(config, device)
    scores = d.a * d.s * d.s * d.b // d.t
    if flash_attention(config, device):
        return 4 * scores // d.s  # the fp32 log-sum-exp per query
    total = d.e * scores
    if config.model.attention_dropout > 0:
        total += (d.k + d.e) * scores
    return total


def full_layer_activation_bytes(config: Config, device: str = "cuda") -> int:
    """Bytes one transformer layer keeps for one micro-batch without any recompute."""
    d = dims(config, device)
    total = 4 * d.e * d.bsh // d.r + 16 * d.b * d.s // d.r + 4 * d.e * d.bsh // d.t + 2 * d.e * d.b * d.s * d.f // d.t
    if config.model.hidden_dropout > 0:
        total += 2 * d.k * d.bsh // d.r
    return total + attention_core_bytes(config, device)


def layer_activation_bytes(config: Config, device: str = "cuda") -> int:
    """Bytes one transformer layer keeps for one micro-batch with the config's selective recompute
    (full recompute is per stage: stage_layer_bytes)."""
    full = full_layer_activation_bytes(config, device)
    if config.model.recompute_granularity == "selective":
        return full - attention_core_bytes(config, device)
    return full


def stage_layer_bytes(config: Config, layers: int, device: str = "cuda") -> Tuple[int, int]:
    """(kept, transient) for a stage's `layers` transformer layers and one micro-batch: what they keep
    between forward and backward, and the most that recompute rebuilds at once in backward."""
    m = config.model
    d = dims(config, device)
    per_layer = layer_activation_bytes(config, device)
    if m.recompute_granularity == "selective":
        return layers * per_layer, (attention_core_bytes(config, device) if layers else 0)
    if m.recompute_granularity != "full":
        return layers * per_layer, 0
    kept, transient = 0, 0
    for start, end, again in recompute_chunks(m.recompute_method, m.recompute_num_layers, layers):
        if again:
            kept += d.e * d.bsh // d.r  # the chunk's input
            transient = max(transient, (end - start) * per_layer)
        else:
            kept += (end - start) * per_layer
    return kept, transient


def embedding_activation_bytes(config: Config, device: str = "cuda") -> int:
    m, d = config.model, dims(config, device)
    bs = d.b * d.s
    total = 8 * bs + (8 * bs if m.position_embedding_type == "learned_absolute" else 0) + (bs if d.t > 1 else 0)
    return total + (d.k * d.bsh // d.r if m.hidden_dropout > 0 else 0)


def head_activation_bytes(config: Config) -> int:
    d = dims(config, "cuda")
    bs = d.b * d.s
    return 2 * d.e * d.bsh // d.r + 8 * bs // d.r + 4 * bs * config.model.padded_vocab_size // d.t + 17 * bs


def head_transient_bytes(config: Config) -> int:
    d = dims(config, "cuda")
    return (d.e if d.e < 4 else 0) * d.b * d.s * config.model.padded_vocab_size // d.t


def stage_output_bytes(config: Config) -> int:
    """What crosses a pipeline stage boundary per micro-batch: [b, s, h], or [b, s/t, h] under sequence
    parallelism (also the size of each pipeline-engine buffer)."""
    d = dims(config, "cuda")
    return d.e * d.bsh // d.r
