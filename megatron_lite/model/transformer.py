"""Pre-norm GPT transformer layer on tensor-parallel building blocks: GPT-2's block (LayerNorm, GeLU
MLP, biases, multi-head attention) or the Llama family's (RMSNorm, SwiGLU, grouped-query attention, no
biases, or Qwen2's on the QKV linear alone, RoPE with Llama 3.1 scaling), as the model flags say.

Activations are [b, s, h] (batch first). Heads and the MLP's inner width are
split across TP ranks by the Column/Row parallel layers; this file calls no
process-group function itself. Layer N's dropouts draw from its own streams
(parallel/random.py), so its masks do not depend on which pipeline stage runs it.

With sequence_parallel (--sequence-parallel) the residual stream, the LayerNorms and
the residual dropout work on this TP rank's part of the sequence, [b, s/tp, h]: the
column-parallel linears all-gather it, the row-parallel ones reduce-scatter back to it.
With context parallelism (--context-parallel-size C) every activation outside attention holds this
CP rank's s/C tokens; attention trades that split for a split of its heads by one all-to-all of q, k
and v and trades back after the core by another (parallel/context_parallel.py), so the core and RoPE
see whole sequences at their true positions.
Heads are --kv-channels wide (hidden / heads unless given): the projection maps [b, s, a hd] back to
[b, s, h]. With --qk-layernorm each query and key head is normalised over its hd before RoPE (and before
the context-parallel all-to-all, on this rank's part of the sequence), one norm weight shared by the heads.
Selective recompute (--recompute-granularity selective) recomputes the attention core
(scores, softmax, dropout, x V) in backward; full recompute runs whole layers under
checkpoint (model/recompute.py).
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention_mask import ATTENTION_WORK, allowed_keys, document_segments, positions_in_documents
from megatron_lite.model.attention_options import layer_window
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax
from megatron_lite.model.mlp import ParallelMLP, normal_init, scaled_normal_init
from megatron_lite.model.moe import MoELayer
from megatron_lite.model.moe_options import is_moe_layer
from megatron_lite.model.norms import build_head_norm, build_norm
from megatron_lite.parallel.context_parallel import (
    context_parallel_groups,
    cp_world_size,
    heads_to_sequence,
    sequence_to_heads,
)
from megatron_lite.parallel.layers import RowParallelLinear
from megatron_lite.parallel.qkv import QKVParallelLinear
from megatron_lite.parallel.random import (
    checkpoint,
    get_rng_tracker,
    layer_rng,
    layer_sequence_shard_rng,
    layer_split_rng,
)
from megatron_lite.parallel.tp import tp_world_size


# Llama 3.1's RoPE scaling constants (its params.json; transformers' rope_type "llama3"): wavelengths
# shorter than ORIGINAL / HIGH are kept, longer than ORIGINAL / LOW divided by the factor, and the band
# between blended.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_scaled_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling of rotary inverse frequencies (fp32)."""
    wavelength = 2 * math.pi / inv_freq
    long_limit = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    short_limit = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    # 0 at the long end of the band, 1 at the short end.
    smooth = ((LLAMA3_ORIGINAL_MAX_POSITIONS / wavelength - LLAMA3_LOW_FREQ_FACTOR)
              / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR))
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_limit, inv_freq / factor, inv_freq)
    in_band = (wavelength >= short_limit) & (wavelength <= long_limit)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, rotate-half as in Llama) on queries and keys, positions
    offset..offset+s-1; scaling_factor applies Llama 3.1's frequency scaling."""

    def __init__(self, head_dim: int, base: int, scaling_factor: Optional[float] = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling_factor is not None:
            inv_freq = llama3_scaled_frequencies(inv_freq, scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        # q [b, np, s, hd] and k [b, ng, s, hd] at positions offset..offset+s-1 (one cos/sin table), or at
        # `positions` [b, s] (positions restarting per document: a table per sample, [b, 1, s, hd])
        s, half = q.shape[2], q.shape[3] // 2
        if positions is None:
            positions = torch.arange(offset, offset + s, device=q.device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)  # [s, hd/2]; both halves of a head turn by these angles
        else:
            freqs = (positions.to(torch.float32)[..., None] * self.inv_freq)[:, None]  # [b, 1, s, hd/2]
        cos = freqs.cos().to(q.dtype)
        cos = torch.cat((cos, cos), dim=-1)  # [.., s, hd]
        sin = freqs.sin().to(q.dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        # Rotate-half, x cos + [-x2, x1] sin, written as x cos + roll(x, hd/2) [-sin, sin]: the same products,
        # without negating and concatenating x's halves (and, in backward, their gradients).
        return tuple(x * cos + x.roll(half, dims=-1) * signed_sin for x in (q, k))


# What `--attention-backend auto` takes per kind of device; the one place that rule lives.
#   cpu:  sdpa, measured faster in whole training steps (benchmarks/bench_training.py --part single,
#         README "Benchmarks").
#   cuda: sdpa until measured otherwise: the fused path writes the [b, heads, s, s] scores that SDPA's
#         flash kernel never materialises (on CPU the fused path is already 0.61x of SDPA at seq 1024).
#         scripts/gpu_check.sh step b times whole causal attention (our fused softmax between two
#         matmuls vs SDPA) for fp16/bf16 at s = 512..8192, names the winner, and fails while this
#         entry disagrees with it; its report is the table to cite here.
AUTO_ATTENTION_BACKEND = {"cpu": "sdpa", "cuda": "sdpa"}


def resolve_attention_backend(backend: str, device_type: Optional[str] = None) -> str:
    """`auto` -> AUTO_ATTENTION_BACKEND for this kind of device; another backend as given."""
    if backend != "auto":
        return backend
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return AUTO_ATTENTION_BACKEND.get(device_type, "sdpa")


class ParallelAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool = False):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        groups = config.num_query_groups or heads
        self.head_dim = config.head_dim
        # The master weight is [Q; K; V] with `groups` key/value heads; each rank takes whole query heads
        # and the key/value groups they use (parallel/qkv.py). Its bias may stand alone (--add-qkv-bias: Qwen2).
        self.query_key_value = QKVParallelLinear(h, heads, groups, self.head_dim, config.qkv_bias,
                                                 normal_init(config.init_method_std), sequence_parallel)
        # QK-norm: one [hd] norm for every query head, one for every key head (Megatron-LM's names).
        self.q_layernorm = build_head_norm(config) if config.qk_layernorm else None
        self.k_layernorm = build_head_norm(config) if config.qk_layernorm else None
        self.local_heads = heads // tp_world_size()
        self.local_groups = self.query_key_value.local_groups
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = resolve_attention_backend(config.attention_backend)
        self.softmax = FusedScaleMaskSoftmax(
            attn_mask_type="causal", scale=self.scale,
            softmax_in_fp32=config.attention_softmax_in_fp32, fusion=config.masked_softmax_fusion,
        )
        # Documents and windows: an explicit mask (model/attention_mask.py), True = masked for this kernel.
        self.masked_softmax = FusedScaleMaskSoftmax(
            attn_mask_type="padding", scale=self.scale,
            softmax_in_fp32=config.attention_softmax_in_fp32, fusion=config.masked_softmax_fusion,
        )
        self.window = layer_window(config, layer_number)
        self.document_mask = config.reset_attention_mask
        self.document_positions = config.reset_position_ids and config.position_embedding_type == "rope"
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.dropout_rng = layer_split_rng(layer_number)
        self.rotary = (RotaryEmbedding(self.head_dim, config.rotary_base,
                                       config.rope_scaling_factor if config.use_rope_scaling else None)
                       if config.position_embedding_type == "rope" else None)
        self.dense = RowParallelLinear(heads * self.head_dim, h, bias=config.add_bias_linear,
                                       input_is_parallel=True,
                                       init_method=scaled_normal_init(config.init_method_std, config.num_layers),
                                       sequence_parallel=sequence_parallel)
        self.recompute_core = config.recompute_granularity == "selective"
        self.context_parallel = cp_world_size()

    def forward(self, x: torch.Tensor, kv_cache=None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """kv_cache (generation only): an object with `offset` (tokens already cached) and
        `append(k, v) -> (all keys, all values)`; x then holds the tokens after those. documents: [b, s]
        each token's document in the whole sequence (data/documents.py), with --reset-attention-mask or
        --reset-position-ids."""
        offset = 0 if kv_cache is None else kv_cache.offset
        # [b, s, h] (sequence parallel: [b, s/tp, h]) -> [b, s, (np + 2 ng) hd], np heads and ng groups here
        qkv = self.query_key_value(x)
        b, s, _ = qkv.shape
        hd = self.head_dim
        q, k, v = qkv.split((self.local_heads * hd, self.local_groups * hd, self.local_groups * hd), dim=-1)

        def heads(t, n, norm=None):  # [b, s, n*hd] -> [b, n, s, hd]
            t = t.view(b, s, n, hd)
            # QK-norm: each head over its hd, in [b, s, n, hd] order, so a norm that writes a new tensor
            # (LayerNorm) keeps the layout the context's reshape after the core can view
            return (t if norm is None else norm(t)).transpose(1, 2)

        q, k = heads(q, self.local_heads, self.q_layernorm), heads(k, self.local_groups, self.k_layernorm)
        v = heads(v, self.local_groups)
        if self.context_parallel > 1:
            q, k, v = self._whole_sequences(q, k, v)
        if self.rotary is not None:
            positions = positions_in_documents(documents) if self.document_positions and documents is not None else None
            q, k = self.rotary(q, k, offset, positions)
        mask, segments = None, None
        if self.document_mask and documents is not None and not offset:
            segments = document_segments(documents)  # few documents: attend document by document
        if segments is None and not offset and (self.window is not None or self.document_mask):
            mask = allowed_keys(q.shape[2], q.device, documents if self.document_mask else None, self.window)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [b, ng, offset + s, hd]: groups are cached, not heads
        core = self._core if segments is None else functools.partial(self._by_document, segments=segments)
        if kv_cache is None and self.training:
            full = q.shape[0] * q.shape[2] ** 2
            ATTENTION_WORK.record(full if segments is None else sum((e - a) ** 2 for r in segments for a, e in r), full)
        if self.recompute_core and kv_cache is None and torch.is_grad_enabled():
            # Only q, k, v (views of qkv) and the context are kept; the [b, np, s, s] scores,
            # probabilities and dropout mask are made again in backward, with the same mask.
            context = checkpoint(core, q, k, v, 0, mask)
        else:
            context = core(q, k, v, offset, mask)
        context = sequence_to_heads(context)  # context parallel: [b, np/C, s, hd] -> [b, np, s/C, hd]
        context = context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, np hd]
        return self.dense(context)  # [b, s, h] reduced over TP (sequence parallel: [b, s/tp, h])

    def _whole_sequences(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [b, np, s/C, hd], k and v [b, ng, s/C, hd] -> every token of this CP rank's 1/C of the heads:
        [b, np/C, s, hd] and [b, max(ng, C)/C, s, hd], by one all-to-all of the three packed together.
        With fewer key/value groups than CP ranks each group is repeated for the ranks whose query heads
        use it (validation allows ng dividing C), as the heads' order keeps a group's queries adjacent."""
        b, heads, s, hd = q.shape
        c, groups = self.context_parallel, context_parallel_groups(k.shape[1], self.context_parallel)
        if groups > k.shape[1]:
            k, v = (t.repeat_interleave(groups // k.shape[1], dim=1) for t in (k, v))
        # Chunk j of every tensor (its heads j*n/C..) goes to CP rank j in one message.
        packed = torch.cat([t.reshape(b, c, t.shape[1] // c, s, hd) for t in (q, k, v)], dim=2)
        whole = heads_to_sequence(packed.view(b, heads + 2 * groups, s, hd))
        return whole.split((heads // c, groups // c, groups // c), dim=1)

    def _by_document(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, mask, segments):
        """The attention core document by document (segments: per sample, its documents' token ranges):
        causal inside each, through the window where a document is longer than it; the blocks between
        documents, which the mask would zero, are never computed."""
        rows = []
        for r, ranges in enumerate(segments):
            parts = []
            for a, e in ranges:
                inside = None
                if self.window is not None and e - a > self.window + 1:
                    inside = allowed_keys(e - a, q.device, None, self.window)
                parts.append(self._core(q[r:r + 1, :, a:e], k[r:r + 1, :, a:e], v[r:r + 1, :, a:e], 0, inside))
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0,
              mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores, causal softmax, dropout, x V: q [b, np, s, hd], k and v [b, ng, s', hd] -> [b, np, s, hd].
        mask: bool [b or 1, 1, s, s], True where a query may attend a key (documents, window), else causal.

        A group's np/ng query heads are adjacent, so viewing q as [b, ng, (np/ng) s, hd] multiplies each
        group's keys and values once, without repeating them per head."""
        b, heads, s, hd = q.shape
        groups = k.shape[1]
        # Heads are split across TP ranks, so their dropout masks must differ per rank.
        with get_rng_tracker().fork(self.dropout_rng):
            if self.backend == "sdpa" and not offset:
                # One kernel for scores, causal softmax, dropout and values (grouped keys and values
                # read per group); its dropout draws from the stream forked above like nn.Dropout would.
                p = self.attention_dropout.p if self.training else 0.0
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                      scale=self.scale, enable_gqa=groups != heads)
            grouped_q = q.reshape(b, groups, heads // groups * s, hd)
            scores = torch.matmul(grouped_q, k.transpose(-2, -1)).view(b, heads, s, -1)  # [b, np, s, s']
            if offset:
                # Decoding after cached tokens: scores are [s, offset + s], not the square causal case
                # that SDPA's is_causal and the fused kernel handle.
                probs = self.attention_dropout(self._softmax_after_cache(scores, offset))
            elif mask is not None:
                probs = self.attention_dropout(self.masked_softmax(scores, ~mask))
            else:
                probs = self.attention_dropout(self.softmax(scores))
            context = torch.matmul(probs.reshape(b, groups, heads // groups * s, -1), v)  # [b, ng, (np/ng) s, hd]
            return context.view(b, heads, s, hd)

    def _softmax_after_cache(self, scores: torch.Tensor, offset: int) -> torch.Tensor:
        """Causal softmax for queries at positions offset.. over keys 0..offset+s-1 (not square, so
        not the fused kernel's case); a windowed layer also masks the keys more than its window behind."""
        s, keys = scores.shape[-2], scores.shape[-1]
        future = torch.ones(s, keys, dtype=torch.bool, device=scores.device).triu(offset + 1)
        if self.window is not None:
            future |= torch.ones(s, keys, dtype=torch.bool, device=scores.device).tril(offset - self.window - 1)
        probs = torch.softmax(scores.float().masked_fill(future, float("-inf")) / math.sqrt(self.head_dim), dim=-1)
        return probs.to(scores.dtype)


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(MLP(norm(x))).

    layer_number counts from 1 over the whole model and names the layer's dropout streams.
    """

    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config, sequence_parallel)
        self.attention = ParallelAttention(config, layer_number, sequence_parallel)
        self.post_attention_layernorm = build_norm(config, sequence_parallel)
        self.mlp = (MoELayer(config, sequence_parallel, layer_number) if is_moe_layer(config, layer_number)
                    else ParallelMLP(config, sequence_parallel))
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        # Replicated residual stream: one stream seeded alike on every TP rank keeps the replicas equal.
        # Sequence parallel: each TP rank holds other positions, so each draws from its own stream.
        self.dropout_rng = layer_sequence_shard_rng(layer_number) if sequence_parallel else layer_rng(layer_number)

    def _residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork(self.dropout_rng):
            return x + self.hidden_dropout(branch)

    def forward(self, x, kv_cache=None):
        """x: hidden states [b, s, h]; or, when samples carry documents, (hidden states, document ids
        [b, s]), which the layer passes on to the next (what crosses pipeline stages)."""
        if isinstance(x, tuple):
            hidden, documents = x
            return self._layer(hidden, kv_cache, documents), documents
        return self._layer(x, kv_cache)

    def _layer(self, x: torch.Tensor, kv_cache=None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self._residual(x, self.attention(self.input_layernorm(x), kv_cache, documents))
        return self._residual(x, self.mlp(self.post_attention_layernorm(x)))
