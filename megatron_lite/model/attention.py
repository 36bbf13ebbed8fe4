"""Self-attention on tensor-parallel building blocks: multi-head or grouped-query, RoPE or learned
positions (model/rotary.py), the fused softmax, SDPA or eager, causal, windowed or by document.

q, k and v come from one column-parallel QKV linear (parallel/qkv.py), split over TP by heads; the
projection is row-parallel. Heads are --kv-channels wide (hidden / heads unless given): the projection
maps [b, s, a hd] back to [b, s, h]. With --qk-layernorm each query and key head is normalised over its
hd before RoPE (and before the context-parallel all-to-all, on this rank's part of the sequence), one
norm weight shared by the heads.
With context parallelism (--context-parallel-size C) attention trades the CP rank's s/C tokens for a
split of its heads by one all-to-all of q, k and v and trades back after the core by another
(parallel/context_parallel.py), so the core and RoPE see whole sequences at their true positions.
Selective recompute (--recompute-granularity selective) recomputes the attention core
(scores, softmax, dropout, x V) in backward.
With --softmax-type off-by-one or learnable every head has a sink logit in its softmax's denominator
(`softmax_offset`, Megatron-LM's name; model/attention_sinks.py for SDPA), split over TP with the heads
and, inside the core, over CP with them.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention_mask import ATTENTION_WORK, allowed_keys, document_segments, positions_in_documents
from megatron_lite.model.attention_options import layer_window
from megatron_lite.model.attention_sinks import sdpa_with_sinks
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax, softmax_with_sinks
from megatron_lite.model.mlp import normal_init, scaled_normal_init
from megatron_lite.model.norms import build_head_norm
from megatron_lite.model.rotary import RotaryEmbedding
from megatron_lite.parallel.context_parallel import (
    context_parallel_groups,
    cp_rank,
    cp_world_size,
    heads_to_sequence,
    sequence_to_heads,
)
from megatron_lite.parallel.layers import RowParallelLinear, _master_slice, _parameter
from megatron_lite.parallel.qkv import QKVParallelLinear
from megatron_lite.parallel.random import checkpoint, dropout_draws, layer_split_rng, run_in_stream
from megatron_lite.parallel.tp import tp_world_size



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
        self.head_dim = config.head_dim  # queries' and keys' width
        self.value_dim = config.value_head_dim
        self.local_heads = heads // tp_world_size()
        self._build_projections(config, sequence_parallel)
        self._build_sinks(config)
        self.scale = self._softmax_scale(config)
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
        self.rotary = RotaryEmbedding.of(config) if config.position_embedding_type == "rope" else None
        self.dense = RowParallelLinear(heads * self.value_dim, h, bias=config.add_bias_linear,
                                       input_is_parallel=True,
                                       init_method=scaled_normal_init(config.init_method_std, config.num_layers),
                                       sequence_parallel=sequence_parallel)
        self.recompute_core = config.recompute_granularity == "selective"
        self.context_parallel = cp_world_size()

    def _build_projections(self, config: ModelConfig, sequence_parallel: bool) -> None:
        """The layers that make q, k and v from the hidden state; sets local_groups (key/value heads here)."""
        heads = config.num_attention_heads
        # The master weight is [Q; K; V] with `groups` key/value heads; each rank takes whole query heads
        # and the key/value groups they use (parallel/qkv.py). Its bias may stand alone (--add-qkv-bias: Qwen2).
        self.query_key_value = QKVParallelLinear(config.hidden_size, heads, config.num_query_groups or heads,
                                                 self.head_dim, config.qkv_bias,
                                                 normal_init(config.init_method_std), sequence_parallel)
        # QK-norm: one [hd] norm for every query head, one for every key head (Megatron-LM's names).
        self.q_layernorm = build_head_norm(config) if config.qk_layernorm else None
        self.k_layernorm = build_head_norm(config) if config.qk_layernorm else None
        self.local_groups = self.query_key_value.local_groups

    def _build_sinks(self, config: ModelConfig) -> None:
        """softmax_offset [heads/TP]: the learned sinks of this rank's heads (cut from one [heads] master, so any
        TP builds the same model; initialised as transformers' gpt-oss does, normal with --init-method-std), a
        zero buffer for off-by-one, None for the vanilla softmax."""
        if config.softmax_type == "learnable":
            heads = config.num_attention_heads
            value = _master_slice((heads,), 0, (heads,), normal_init(config.init_method_std))
            self.softmax_offset = _parameter((self.local_heads,), torch.float32, value, True, 0)
        else:
            zeros = torch.zeros(self.local_heads) if config.softmax_type == "off-by-one" else None
            self.register_buffer("softmax_offset", zeros, persistent=False)

    def _sinks(self, heads_here: int) -> Optional[torch.Tensor]:
        """The sinks of the heads the core sees: this TP rank's, or under context parallelism this CP rank's
        1/C of them (heads_to_sequence gives CP rank r the heads r n/C ..)."""
        sinks = self.softmax_offset
        if sinks is None or heads_here == sinks.shape[0]:
            return sinks
        return sinks.narrow(0, cp_rank() * heads_here, heads_here)

    def _softmax_scale(self, config: ModelConfig) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def _project(self, x: torch.Tensor):
        """[b, s, h] (sequence parallel: [b, s/tp, h]) -> q [b, np, s, hd], k and v [b, ng, s, hd] (np heads and
        ng groups on this rank), before positions."""
        qkv = self.query_key_value(x)  # [b, s, (np + 2 ng) hd]
        b, s, _ = qkv.shape
        hd = self.head_dim
        q, k, v = qkv.split((self.local_heads * hd, self.local_groups * hd, self.local_groups * hd), dim=-1)

        def heads(t, n, norm=None):  # [b, s, n*hd] -> [b, n, s, hd]
            t = t.view(b, s, n, hd)
            # QK-norm: each head over its hd, in [b, s, n, hd] order, so a norm that writes a new tensor
            # (LayerNorm) keeps the layout the context's reshape after the core can view
            return (t if norm is None else norm(t)).transpose(1, 2)

        return (heads(q, self.local_heads, self.q_layernorm), heads(k, self.local_groups, self.k_layernorm),
                heads(v, self.local_groups))

    def forward(self, x: torch.Tensor, kv_cache=None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """kv_cache (generation only): an object with `offset` (tokens already cached) and
        `append(k, v) -> (all keys, all values)`; x then holds the tokens after those. documents: [b, s]
        each token's document in the whole sequence (data/documents.py), with --reset-attention-mask or
        --reset-position-ids."""
        offset = 0 if kv_cache is None else kv_cache.offset
        q, k, v = self._project(x)
        b, s = q.shape[0], q.shape[2]
        if self.context_parallel > 1:
            q, k, v = self._whole_sequences(q, k, v)
        if self.rotary is not None:
            positions = positions_in_documents(documents) if self.document_positions and documents is not None else None
            q, k = self.rotary(q, k, offset, positions)
        mask, segments = None, None
        if self.document_mask and documents is not None and not offset and not torch.compiler.is_compiling():
            # Few documents: attend document by document. Not in a compiled layer: the ranges are read to the
            # host and shape the work, so it takes the mask below (every block computed, and counted so).
            segments = document_segments(documents)
        if segments is None and not offset and (self.window is not None or self.document_mask):
            mask = allowed_keys(q.shape[2], q.device, documents if self.document_mask else None, self.window)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [b, ng, offset + s, hd]: groups are cached, not heads
        core = self._core if segments is None else functools.partial(self._by_document, segments=segments)
        if kv_cache is None and self.training and not torch.compiler.is_compiling():
            # A compiled layer records nothing (its Python counters would be guarded and recompile each step);
            # it computes every block, share 1, what `take` gives when nothing was recorded.
            full = q.shape[0] * q.shape[2] ** 2
            ATTENTION_WORK.record(full if segments is None else sum((e - a) ** 2 for r in segments for a, e in r), full)
        if self.recompute_core and kv_cache is None and torch.is_grad_enabled():
            # Only q, k, v (views of qkv) and the context are kept; the [b, np, s, s] scores,
            # probabilities and dropout mask are made again in backward, with the same mask.
            context = checkpoint(core, q, k, v, 0, mask, draws=dropout_draws(self.attention_dropout))
        else:
            context = core(q, k, v, offset, mask)
        context = sequence_to_heads(context)  # context parallel: [b, np/C, s, hd] -> [b, np, s/C, hd]
        context = context.transpose(1, 2).reshape(b, s, self.local_heads * self.value_dim)  # [b, s, np hd_v]
        return self.dense(context)  # [b, s, h] reduced over TP (sequence parallel: [b, s/tp, h])

    def _whole_sequences(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [b, np, s/C, hd], k and v [b, ng, s/C, hd] -> every token of this CP rank's 1/C of the heads:
        [b, np/C, s, hd] and [b, max(ng, C)/C, s, hd], by one all-to-all of the three packed together (two
        where values are narrower than queries and keys: MLA).
        With fewer key/value groups than CP ranks each group is repeated for the ranks whose query heads
        use it (validation allows ng dividing C), as the heads' order keeps a group's queries adjacent."""
        b, heads, s, hd = q.shape
        c, groups = self.context_parallel, context_parallel_groups(k.shape[1], self.context_parallel)
        if groups > k.shape[1]:
            k, v = (t.repeat_interleave(groups // k.shape[1], dim=1) for t in (k, v))

        def exchange(*tensors):
            # Chunk j of every tensor (its heads j*n/C..) goes to CP rank j in one message.
            width = tensors[0].shape[-1]
            packed = torch.cat([t.reshape(b, c, t.shape[1] // c, s, width) for t in tensors], dim=2)
            whole = heads_to_sequence(packed.view(b, sum(t.shape[1] for t in tensors), s, width))
            return whole.split([t.shape[1] // c for t in tensors], dim=1)

        if v.shape[-1] == hd:
            return exchange(q, k, v)
        return (*exchange(q, k), *exchange(v))

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
        """Scores, causal softmax, dropout, x V: q [b, np, s, hd], k [b, ng, s', hd] and v [b, ng, s', hd_v]
        -> [b, np, s, hd_v].
        mask: bool [b or 1, 1, s, s], True where a query may attend a key (documents, window), else causal.

        A group's np/ng query heads are adjacent, so viewing q as [b, ng, (np/ng) s, hd] multiplies each
        group's keys and values once, without repeating them per head."""
        if dropout_draws(self.attention_dropout):
            # Heads are split across TP ranks, so their dropout masks must differ per rank.
            return run_in_stream(self.dropout_rng, self._core_without_stream, q, k, v, offset, mask)
        return self._core_without_stream(q, k, v, offset, mask)

    def _core_without_stream(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0,
                             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, heads, s, hd = q.shape
        groups = k.shape[1]
        sinks = self._sinks(heads)
        if self.backend == "sdpa" and not offset and sinks is not None:
            p = self.attention_dropout.p if self.training else 0.0
            return sdpa_with_sinks(q, k, v, mask, sinks, self.scale, p)
        if self.backend == "sdpa" and not offset:
            # One kernel for scores, causal softmax, dropout and values (grouped keys and values
            # read per group); its dropout draws from the stream _core swapped in, as nn.Dropout would.
            # Values narrower than queries and keys (MLA) are padded to their width, as transformers' FA2
            # path and Megatron-LM's packed-sequence path do: CPU's flash kernel refuses them otherwise
            # and the math path keeps [b, np, s, s] (benchmarks/bench_mla.py --part core).
            p = self.attention_dropout.p if self.training else 0.0
            width = v.shape[-1]
            if width != hd:
                v = F.pad(v, (0, hd - width))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                 scale=self.scale, enable_gqa=groups != heads)
            return out if width == hd else out[..., :width]
        grouped_q = q.reshape(b, groups, heads // groups * s, hd)
        scores = torch.matmul(grouped_q, k.transpose(-2, -1)).view(b, heads, s, -1)  # [b, np, s, s']
        if offset:
            # Decoding after cached tokens: scores are [s, offset + s], not the square causal case
            # that SDPA's is_causal and the fused kernel handle.
            probs = self.attention_dropout(self._softmax_after_cache(scores, offset, sinks))
        elif mask is not None:
            probs = self.attention_dropout(self.masked_softmax(scores, ~mask, sinks))
        else:
            probs = self.attention_dropout(self.softmax(scores, sinks=sinks))
        context = torch.matmul(probs.reshape(b, groups, heads // groups * s, -1), v)  # [b, ng, (np/ng) s, hd_v]
        return context.view(b, heads, s, v.shape[-1])

    def _softmax_after_cache(self, scores: torch.Tensor, offset: int, sinks: Optional[torch.Tensor] = None
                             ) -> torch.Tensor:
        """Causal softmax for queries at positions offset.. over keys 0..offset+s-1 (not square, so
        not the fused kernel's case); a windowed layer also masks the keys more than its window behind."""
        s, keys = scores.shape[-2], scores.shape[-1]
        future = torch.ones(s, keys, dtype=torch.bool, device=scores.device).triu(offset + 1)
        if self.window is not None:
            future |= torch.ones(s, keys, dtype=torch.bool, device=scores.device).tril(offset - self.window - 1)
        logits = scores.float().masked_fill(future, float("-inf")) * self.scale
        probs = torch.softmax(logits, dim=-1) if sinks is None else softmax_with_sinks(logits, sinks)
        return probs.to(scores.dtype)
