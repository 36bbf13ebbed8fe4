"""Bytes autograd keeps for backward for one micro-batch: per transformer layer, embedding and head.

What each autograd node of our layer keeps (model/transformer.py; storages counted once), with
e = bytes of an activation element (4 fp32, 2 bf16/fp16; weights are the same dtype), k = bytes of a
dropout mask element (1 on CUDA, where native_dropout keeps a bool mask; e on CPU, where dropout
keeps a mask in the input's dtype: measured), t = TP, r = t with --sequence-parallel and 1 without
(what divides the residual stream), c = CP, b = micro batch, S = sequence, s = S / c the tokens of a
sample this rank holds outside attention (S without context parallelism), h = hidden, f = FFN width,
a = heads, g = key/value groups, d = the head width (--kv-channels, h / a when not given); per TP
rank n = a/t query heads and m = max(g/t, 1) groups; inside attention a rank holds all S tokens of
n_c = n/c heads and m_c = m_e/c groups, where m_e = m, or c when m < c (keys and values repeated to c
groups before the all-to-all). Without
context parallelism n_c = n, m_c = m. Q = e b S n_c d and K = e b S m_c d bytes of the queries and keys
attention runs on (QKV = Q + 2K: the fused output, or with context parallelism the all-to-all's):

  2 norms, each with its output (the next linear's input), / r (sequence parallel: shards; the
  column-parallel linears keep the shard and all-gather it again in backward):
    LayerNorm  input, output, mean and rstd            2 e bsh + 8 bs (CUDA: fp32 statistics;
                                                       CPU: 2 e bs, the input's dtype)
    RMSNorm    fp32 input (the input itself in fp32,   (4 + 2e) bsh + 4 bs
               a copy otherwise), the normalised input cast back (the weight's gradient),
               output, fp32 rstd
  q, k, v: what the attention keeps of them (below)    `attention_input_bytes`
  RoPE: its cos and signed sin tables (shared by q, k) 2 e S r (r = d, or --rotary-percent of it)
  g < t: the QKV weight multiplied with, its group's   e (n + 2) d h  (parallel/qkv.py; made per
         K/V rows gathered                                            micro-batch)
  attention context (the projection's input)           e b s n d (e bsh / t when a d = h)
  QK-norm (--qk-layernorm; `qk_norm_bytes`), on the n + m heads of this rank's s tokens, R = b s (n + m):
    LayerNorm  input (a view), mean and rstd           2 R x 4 (CUDA) or 2 R e (CPU)
    RMSNorm    fp32 input (a view at fp32, a copy at   4 R + e R d (+ 4 R d at 16 bits)
               16 bits), fp32 rstd, normalised input cast back
    a view keeps the whole QKV output e b s (n + 2m) d unless the attention keeps it already; QK-norm's
    outputs are new tensors, so (without context parallelism) q and k reach the attention as with RoPE
  MLP  GeLU: its input and output                      2 e bsf / t
       SwiGLU: [gate; up], silu(gate), the product     4 e bsf / t
       other gated units (--quick-geglu, a clamp,      3 e bsf / t
       an offset): [gate; up], the product (model/activation.py recomputes the rest; `mlp_inner_copies`)
  attention core (`attention_core_bytes`), by kernel (`attention_kernel`):
    fused   the softmax output                         e n_c S^2 b
            attention dropout (p > 0): mask + output   (k + e) n_c S^2 b
    flash   (SDPA) the fp32 log-sum-exp                4 n_c S b, no S^2 term
            c > 1: its output [b, n_c, S, d], which    e b S n_c d = e b s n d
            the all-to-all copies into the projection's input (at c = 1 that input is the output's storage,
            but for queries made heads-major by partial RoPE's concatenation, which the output's layout follows)
    math    (SDPA's fallback: on CPU with dropout)     as fused, in fp32 whatever the inputs
  two hidden dropouts (p > 0): masks                   2 k bsh / r
  => Korthikanti et al. 2022, for e = 2, k = 1, f = 4h, GPT-2's block (LayerNorm statistics left out):
     sbh(34 + 5as/h) at t = 1, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34/t + 5as/(ht)) with TP + SP.

q, k and v (measured for every case; `attention_input_bytes`): q and k are views of the QKV output
(with context parallelism: of the all-to-all's output [b, n_c + 2 m_c, S, d]), or with RoPE new
tensors; v is a view. SDPA's kernels keep what they are given (v's view keeps the whole QKV or
all-to-all output). The fused path's matmuls keep the [b m_c, ., d] batches they fold [b, m_c, ., d]
into: a view when b = 1 or m_c = 1, else a copy; queries are regrouped to [b, m_c, (n_c/m_c) S, d]
first, a copy of the QKV output's [b, n, S, d] view when n > m (the all-to-all's heads-major layout
regroups as a view). The math path scales q and k into new tensors, converts 16-bit q, k, v to fp32,
and repeats k and v to n_c heads when n_c > m_c.
Context parallelism keeps nothing else of its all-to-alls (they save no tensor; packing q, k, v and
repeating groups save none): its cost is the all-to-all output kept whole, and flash's output above.

--recompute-granularity selective drops the attention core's terms: its checkpoint keeps q, k, v
as given, and its output is the projection's input (counted above); so sbh 34/t with TP + SP.
Context parallelism divides every term by c: the sbh terms through the tokens (s = S/c), the attention
core's through the heads (n_c = n/c), q, k, v through the heads (and grows K by the repeated groups when
m < c); RoPE's tables (2 e S r, per layer) are its one term that does not shrink.
Under flash SDPA there is no s^2 term to drop: selective saves the log-sum-exp only, and still runs
the attention core twice. Backward rebuilds one layer's attention core at a time (a transient).
--recompute-granularity full keeps each recomputed chunk's input (e bsh / r) instead of its layers'
activations (model/recompute_options.py `recompute_chunks`); backward rebuilds one chunk at a time: up to N
layers' activations with --recompute-method uniform, one layer with block.

First stage adds the embedding (this rank's s tokens): token and position ids (8 bs each), the
out-of-range mask at t > 1 (bs), the dropout mask (k bsh / r). Without dropout under sequence
parallelism at b = 1 the first layer's input shard is a view of the whole embedding output:
e bsh (1 - 1/t) more wherever that input is kept (not by a 16-bit RMSNorm, which keeps its fp32
copy instead).
Last stage adds the final norm (as above, its output being the head's input; the gathered sequence
is not kept), the vocab-parallel cross entropy's fp32 softmax (4 bsV/t), its local targets and
out-of-range mask (9 bs), and the loss mask with the count it divides by (4 bs + 4; with context
parallelism the loss weights, 4 bs, which hold the count: data/context_parallel.py). The cross
entropy works in place on fp32 logits, so the softmax is the logits' own buffer. 16-bit logits live
on while their fp32 copy is made, and backward turns the fp32 gradient into a 16-bit one: a
transient of e bsV/t when e < 4; 2 e bsV/t under the pipeline engine (ZeRO 0/1), whose buffer holds
the last stage's output, the logits, until their backward has run (`head_transient_bytes`).
A non-last stage also keeps its output (e bsh / r, this rank's part of the sequence) per micro-batch in
flight for the send.

With Multi-Token Prediction's D depths the last stage keeps theirs (cost/mtp_activations.py), and the head
works on 1 + D times the tokens (its input the stack of 1 + D final norms' outputs, e (1 + D) bsh / r, a copy:
the main final norm's output is then kept by the first depth, not by the head); what crosses a stage also
carries the depths' tokens, 8 b D s.

An MoE layer keeps, instead of the MLP's terms, what cost/moe_activations.py counts. Multi-head Latent
Attention keeps its latents and its own q, k, v (cost/latent_activations.py) instead of the QKV terms and
QK-norm's; d is then its queries' and keys' width d_n + d_r, and the context, the values and what the core
outputs are d_v wide (Dims.v; d everywhere else).
"""
from __future__ import annotations

from typing import Optional, Tuple

from megatron_lite.config import Config
from megatron_lite.cost.activation_dims import dims
from megatron_lite.cost.latent_activations import latent_attention_input_bytes, latent_bytes
from megatron_lite.cost.moe_activations import mlp_inner_copies, moe_mlp_bytes
from megatron_lite.cost.sink_activations import fused_sink_bytes, sdpa_sink_bytes
from megatron_lite.model.attention_options import needs_document_ids
from megatron_lite.model.recompute_options import recompute_chunks

# The layer's own rules (transformer.py, parallel/qkv.py, parallel/context_parallel.py) are imported where
# they are used: their modules import torch, and tools/estimate_memory.py checks its flags before torch starts.


def attention_kernel(config: Config, device: str) -> str:
    """What runs the attention core: "fused" (our softmax between two matmuls), "flash" (an SDPA kernel
    that keeps the log-sum-exp, no s x s tensor) or "math" (SDPA's eager fallback, s x s tensors kept).
    SDPA on CPU takes its flash kernel without dropout and the math path with it (measured); on CUDA
    the flash kernel (16-bit, grouped keys and values read in place) or the memory-efficient one
    (fp32), which cannot read grouped keys and values: fp32 with groups shared by several local
    heads takes the math path (torch's sdp_utils; not measured here). MLA's values narrower than its queries
    and keys are padded to their width first (model/attention.py), so the same kernels take them."""
    from megatron_lite.model.attention import resolve_attention_backend

    m = config.model
    if resolve_attention_backend(m.attention_backend, device) != "sdpa":
        return "fused"
    if device != "cuda":
        return "flash" if m.attention_dropout == 0 else "math"
    d = dims(config, device)
    grouped = d.attention_heads != d.attention_groups
    return "math" if grouped and config.precision.dtype_name == "fp32" else "flash"


def flash_attention(config: Config, device: str) -> bool:
    """Whether SDPA runs a kernel that keeps no s x s tensor (on CPU only without attention dropout)."""
    return attention_kernel(config, device) == "flash"


def attention_input_bytes(config: Config, device: str = "cuda", checkpointed: bool = False) -> int:
    """Bytes of the q, k, v storages the attention keeps (module docstring), or with `checkpointed`
    what selective recompute's checkpoint keeps of them: its inputs as given. Measured for every case
    (tests/cost/test_memory.py)."""
    return _attention_inputs(config, device, checkpointed)[0]


def _attention_inputs(config: Config, device: str, checkpointed: bool) -> Tuple[int, bool]:
    """(attention_input_bytes, whether they include the whole QKV output, or under context parallelism the
    whole all-to-all output, that a view keeps)."""
    kernel = "flash" if checkpointed else attention_kernel(config, device)
    if config.model.multi_latent_attention:  # nothing of a QKV output to keep whole
        return latent_attention_input_bytes(config, device, kernel, checkpointed), False
    d = dims(config, device)
    n, m = d.attention_heads, d.attention_groups
    q = d.e * d.b * d.S * n * d.head_dim
    kv = d.e * d.b * d.S * m * d.head_dim
    # q and k reach the attention as new tensors (RoPE's, or QK-norm's without an all-to-all after it), else
    # as views of the QKV output (of the all-to-all output under context parallelism)
    fresh = config.model.position_embedding_type == "rope" or (config.model.qk_layernorm and d.c == 1)
    fold_is_view = d.b == 1 or m == 1  # [b, m, ., d] -> [b m, ., d] without a copy
    regroup_is_view = n == m or d.c > 1  # [b, n, S, d] -> [b, m, (n/m) S, d]: see the module docstring
    if kernel == "flash":  # as given
        q_view, k_view, v_view = not fresh, not fresh, True
    elif kernel == "fused":
        q_view, k_view = not fresh and regroup_is_view and fold_is_view, not fresh and fold_is_view
        v_view = fold_is_view
    elif d.e < 4 or n != m:  # math: fp32 copies of 16-bit inputs, or k and v repeated to n heads
        return 3 * 4 * d.b * d.S * n * d.head_dim, False
    else:  # math, fp32: q and k scaled into new tensors
        q_view, k_view, v_view = False, False, fold_is_view
    kept_whole = q_view or k_view or v_view
    whole = q + 2 * kv if kept_whole else 0  # a view keeps the whole QKV output
    return whole + (0 if q_view else q) + (0 if k_view else kv) + (0 if v_view else kv), kept_whole


def qk_norm_bytes(config: Config, device: str = "cuda", checkpointed: bool = False) -> int:
    """What --qk-layernorm's two norms keep, on this rank's n query and m key heads of its s tokens (before
    the all-to-all): LayerNorm its input (a view of the QKV output) with a mean and rstd per head and token
    (fp32 on CUDA, the input's dtype on CPU); RMSNorm its fp32 input (the input itself in fp32: a view; a
    copy otherwise), its fp32 rstd and the normalised input cast back. A view keeps the whole QKV output
    alive, counted here unless the attention keeps it already (`checkpointed` as attention_input_bytes)."""
    if not config.model.qk_layernorm or config.model.multi_latent_attention:  # MLA's: latent_bytes
        return 0
    d = dims(config, device)
    rows = d.b * d.s * (d.local_heads + d.local_groups)
    if config.model.normalization == "RMSNorm":
        total, keeps_view = 4 * rows + d.e * rows * d.head_dim, d.e == 4
        total += 0 if keeps_view else 4 * rows * d.head_dim
    else:
        total, keeps_view = 2 * (4 if device == "cuda" else d.e) * rows, True
    if keeps_view and not (d.c == 1 and _attention_inputs(config, device, checkpointed)[1]):
        total += d.e * d.bs * (d.local_heads + 2 * d.local_groups) * d.head_dim
    return total


def attention_core_bytes(config: Config, device: str = "cuda") -> int:
    """What the attention core (scores, softmax, dropout, x V) keeps beyond its inputs: selective
    recompute's saving."""
    d = dims(config, device)
    scores = d.attention_heads * d.S * d.S * d.b
    kernel = attention_kernel(config, device)
    if kernel == "flash":
        # The fp32 log-sum-exp per query; with context parallelism also its output, no longer the
        # storage the projection's input is. Nor is it where the flash kernel gets queries made heads-major by
        # a concatenation (partial RoPE's; MLA's always): it lays its output out as the queries, and the
        # projection's input is a copy (measured on the CPU). Values narrower than queries and keys (MLA's)
        # take CUDA's memory-efficient kernel, whose output is token-major as the projection reads it (not
        # measured here).
        m = config.model
        concatenated = m.position_embedding_type == "rope" and m.rotary_dim < d.head_dim and d.v == d.head_dim
        output = d.e * d.b * d.S * d.attention_heads * d.v if d.c > 1 or concatenated else 0
        if d.v != d.head_dim:  # MLA's padded values: the output is as wide as queries and keys, and sliced
            output = d.e * d.b * d.S * d.attention_heads * d.head_dim
        return 4 * scores // d.S + output
    # SDPA's math path works in fp32 whatever the inputs (its dropout mask: bool on CUDA, fp32 on CPU).
    e, k = (4, 1 if device == "cuda" else 4) if kernel == "math" else (d.e, d.k)
    total = e * scores
    if config.model.attention_dropout > 0:
        total += (k + e) * scores
    return total


def context_parallel_all_to_all_bytes(config: Config) -> int:
    """Bytes of one layer's forward all-to-all tensors on a rank per micro-batch (its gradients in backward
    are as large): q, k, v packed, [b, s, n + 2 m_e, d] = [b, n_c + 2 m_c, S, d] after it (MLA: q and k
    packed, v of d_v apart), and the context [b, n_c, S, d_v] back; 0 without context parallelism. A rank
    sends (c-1)/c of each."""
    d = dims(config, "cuda")
    if d.c == 1:
        return 0
    n, m = d.attention_heads, d.attention_groups
    return d.e * d.b * d.S * ((n + m) * d.head_dim + (m + n) * d.v)


def norm_bytes(config: Config, device: str = "cuda") -> int:
    """One norm of the residual stream with its output (module docstring), on this rank's shard."""
    d = dims(config, device)
    if config.model.normalization == "RMSNorm":
        return ((4 + 2 * d.e) * d.bsh + 4 * d.bs) // d.r
    statistic = 4 if device == "cuda" else d.e  # mean and rstd: fp32 on CUDA, the input's dtype on CPU
    return (2 * d.e * d.bsh + 2 * statistic * d.bs) // d.r


def attention_mask_bytes(config: Config, device: str = "cuda", selective: bool = False,
                         path: Optional[str] = None) -> int:
    """What one layer keeps for its document / window mask beyond causal attention (model/attention_mask.py),
    by the path it takes (`path`; None: the larger, as the data decides the path):
      mask      a bool [b or 1, 1, S, S] (b with --reset-attention-mask: one per sample; the same on every
                TP and CP rank, which hold whole sequences inside attention): flash SDPA keeps it converted
                to the queries' dtype, the fused softmax and SDPA's math path none of it; selective
                recompute's checkpoint keeps the bool mask it is given instead
      segments  (documents, attended one by one) a bound, not an exact count: the documents' outputs and
                their concatenations, which the context no longer is (at most 2 e b S n_c d), and a
                windowed layer's mask per document longer than the window (at most e b S^2); the s x s
                terms of the fused and math paths shrink to the documents' own (the sum of their squared
                lengths), counted at one document per sample, their most
    Measured: tests/cost/test_memory.py (exact for the mask, the bound for documents one by one)."""
    m, d = config.model, dims(config, device)
    if m.window_size is None and not m.reset_attention_mask:
        return 0
    flash = attention_kernel(config, device) == "flash"
    masks = d.b * d.S * d.S if m.reset_attention_mask else d.S * d.S
    by_path = {"mask": masks if selective else d.e * masks if flash else 0}
    if m.reset_attention_mask:
        outputs = 2 * d.e * d.b * d.S * d.attention_heads * d.v
        windows = d.e * d.b * d.S * d.S if m.window_size is not None else 0
        by_path["segments"] = 0 if selective else outputs + windows
    return by_path[path] if path is not None else max(by_path.values())


def _layer_bytes(config: Config, device: str, selective: bool, moe: bool = False) -> int:
    m, d = config.model, dims(config, device)
    total = 2 * norm_bytes(config, device)
    kernel = attention_kernel(config, device)
    if m.attention_sinks and kernel != "fused" and not selective:  # the sink as one more key: all new tensors
        total += sdpa_sink_bytes(config, device, kernel) + d.e * d.bs * d.local_heads * d.v
    else:
        total += attention_input_bytes(config, device, checkpointed=selective) + d.e * d.bs * d.local_heads * d.v
        total += 0 if selective else attention_core_bytes(config, device)
        total += attention_mask_bytes(config, device, selective)
        total += fused_sink_bytes(config, device) if m.attention_sinks and not selective else 0
    total += qk_norm_bytes(config, device, checkpointed=selective)
    total += latent_bytes(config, device) if m.multi_latent_attention else 0
    if m.position_embedding_type == "rope":  # per sample when positions restart with each document
        total += 2 * d.e * d.S * m.rotary_dim * (d.b if m.reset_position_ids and needs_document_ids(m) else 1)
    if d.g < d.t:
        total += d.e * (d.local_heads + 2) * d.head_dim * d.h
    total += moe_mlp_bytes(config, device) if moe else mlp_inner_copies(m) * d.e * d.bs * d.f // d.t
    if m.hidden_dropout > 0:
        total += 2 * d.k * d.bsh // d.r
    return total


def _is_moe(config: Config, layer_number: Optional[int]) -> bool:
    from megatron_lite.model.moe_options import is_moe_layer

    return layer_number is not None and is_moe_layer(config.model, layer_number)


def full_layer_activation_bytes(config: Config, device: str = "cuda", layer_number: Optional[int] = None) -> int:
    """Bytes one transformer layer keeps for one micro-batch without any recompute; layer_number (from 1)
    says whether it is MoE (None: dense)."""
    return _layer_bytes(config, device, selective=False, moe=_is_moe(config, layer_number))


def layer_activation_bytes(config: Config, device: str = "cuda", layer_number: Optional[int] = None) -> int:
    """Bytes one transformer layer keeps for one micro-batch with the config's selective recompute
    (full recompute is per stage: stage_layer_bytes); layer_number as full_layer_activation_bytes'."""
    return _layer_bytes(config, device, selective=config.model.recompute_granularity == "selective",
                        moe=_is_moe(config, layer_number))


def selective_rebuild_bytes(config: Config, device: str = "cuda") -> int:
    """What backward rebuilds of one layer's attention core under selective recompute: its s x s terms
    (or log-sum-exp) and the copies of q, k, v it folds them into (those the checkpoint does not hold)."""
    copies = attention_input_bytes(config, device) - attention_input_bytes(config, device, checkpointed=True)
    return attention_core_bytes(config, device) + max(copies, 0)


def kv_gather_transient_bytes(config: Config) -> int:
    """g < t: the whole K/V weight rows [2 g d, h] a layer gathers in forward (and their gradient in
    backward) before taking its group's; 0 otherwise."""
    d = dims(config, "cuda")
    return d.e * 2 * d.g * d.head_dim * d.h if d.g < d.t else 0


def stage_layer_bytes(config: Config, layers: int, device: str = "cuda", first_layer: int = 1) -> Tuple[int, int]:
    """(kept, transient) for a stage's `layers` transformer layers (numbered from `first_layer`, which says
    which are MoE) and one micro-batch: what they keep between forward and backward, and the most that
    recompute rebuilds at once in backward."""
    m = config.model
    d = dims(config, device)
    # A layer's bytes depend only on whether it is MoE: summed once per kind (a 104-layer model's plan
    # summed every layer's thousands of times).
    kinds = [_is_moe(config, n) for n in range(first_layer, first_layer + layers)]
    per_kind = {moe: _layer_bytes(config, device, m.recompute_granularity == "selective", moe) for moe in set(kinds)}
    per_layer = [per_kind[moe] for moe in kinds]
    if m.recompute_granularity == "selective":
        return sum(per_layer), (selective_rebuild_bytes(config, device) if layers else 0)
    if m.recompute_granularity != "full":
        return sum(per_layer), 0
    kept, transient = 0, 0
    for start, end, again in recompute_chunks(m.recompute_method, m.recompute_num_layers, layers):
        if again:
            kept += d.e * d.bsh // d.r  # the chunk's input
            transient = max(transient, sum(per_layer[start:end]))
        else:
            kept += sum(per_layer[start:end])
    return kept, transient


def embedding_activation_bytes(config: Config, device: str = "cuda") -> int:
    m, d = config.model, dims(config, device)
    bs = d.bs
    total = 8 * bs + (8 * bs if m.position_embedding_type == "learned_absolute" else 0) + (bs if d.t > 1 else 0)
    if m.hidden_dropout > 0:
        return total + d.k * d.bsh // d.r
    # No dropout copies the sequence shard, which at b = 1 is a view of the whole [1, s, h] output: what
    # keeps the first layer's input (its norm, unless RMSNorm keeps an fp32 copy instead; full recompute's
    # chunk input) keeps all of it alive (measured).
    keeps_input = (m.recompute_granularity == "full" or m.normalization == "LayerNorm" or d.e == 4)
    if d.r > 1 and d.b == 1 and keeps_input:
        total += d.e * d.bsh - d.e * d.bsh // d.r
    return total


def head_activation_bytes(config: Config, device: str = "cuda") -> int:
    """The final norm, the head's input, the cross entropy's softmax and targets; with Multi-Token Prediction's
    D depths for 1 + D times the tokens (cost/mtp_activations.py counts the depths)."""
    d = dims(config, device)
    bs, heads = d.bs, 1 + (config.model.mtp_num_layers or 0)
    # norm_bytes counts the norm's output, which is the head's input; with depths the head's input is the
    # [(1 + D) b, s, h] stack of the final norms' outputs, a copy (the first depth's hnorm keeps the main
    # one's output). Targets, their out-of-range mask and the loss mask per head (the depths' masks one
    # [b, D, s] storage); the count each loss divides by (4 bytes) is gone under context parallelism,
    # whose loss weights already hold it.
    count = 4 if d.c == 1 else 0
    if config.model.output_loss_chunk_size:
        # The chunked output loss (parallel/chunked_cross_entropy.py) keeps its input, the targets (the labels
        # themselves, int64) and a fp32 log-sum-exp per token, no logits; under SP the input it keeps is the
        # gathered [b, s, h], not the norm's shard.
        gathered = heads * d.e * d.bsh * (d.r - 1) // d.r if d.r > 1 else 0
        return (norm_bytes(config, device) + (heads - 1) * d.e * d.bsh // d.r + gathered
                + heads * (16 * bs + count))
    return (norm_bytes(config, device) + (heads - 1) * d.e * d.bsh // d.r
            + heads * (4 * bs * config.model.padded_vocab_size // d.t + 13 * bs + count))


def head_transient_bytes(config: Config) -> int:
    """16-bit logits, beyond the fp32 softmax (module docstring): those of the main model and of each Multi-Token
    Prediction depth, with their 16-bit gradient under the pipeline engine (ZeRO 0/1; measured at PP 2 with 0 and
    2 depths, 2 e (1 + D) bsV/t: tests/cost/test_mtp_memory.py). None in fp32."""
    d = dims(config, "cuda")
    heads = 1 + (config.model.mtp_num_layers or 0)
    chunk = config.model.output_loss_chunk_size
    if chunk:
        # One chunk's fp32 logits and their gradient at a time; with 16-bit weights the fp32 accumulator of the
        # weight's gradient (not measured: parallel/chunked_cross_entropy.py's backward)
        rows = min(chunk, heads * d.bs)
        return 8 * rows * config.model.padded_vocab_size // d.t + (
            4 * config.model.padded_vocab_size // d.t * d.h if d.e < 4 else 0)
    with_gradient = 2 if config.parallel.zero_stage < 2 else 1  # the engine's pipe buffer holds the logits
    return (d.e * with_gradient if d.e < 4 else 0) * heads * d.bs * config.model.padded_vocab_size // d.t


def stage_output_bytes(config: Config) -> int:
    """What crosses a pipeline stage boundary per micro-batch: [b, s, h] (this rank's s = S/c tokens), or
    [b, s/t, h] under sequence parallelism (also the size of each pipeline-engine buffer); with document
    ids, also their int32 [b, S] (the whole sequence, model/attention_mask.py); with Multi-Token Prediction's
    D depths, their int64 tokens [b, D, s] (data/mtp.py, this rank's s, whole over TP) on their way to the
    last stage."""
    m, d = config.model, dims(config, "cuda")
    return (d.e * d.bsh // d.r + (4 * d.b * d.S if needs_document_ids(m) else 0)
            + 8 * d.bs * (m.mtp_num_layers or 0))

