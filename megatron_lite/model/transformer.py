"""Pre-LayerNorm GPT transformer layer on tensor-parallel building blocks.

Activations are [b, s, h] (batch first). Heads and the MLP's inner width are
split across TP ranks by the Column/Row parallel layers; this file calls no
process-group function itself. Layer N's dropouts draw from its own streams
(parallel/random.py), so its masks do not depend on which pipeline stage runs it.

With sequence_parallel (--sequence-parallel) the residual stream, the LayerNorms and
the residual dropout work on this TP rank's part of the sequence, [b, s/tp, h]: the
column-parallel linears all-gather it, the row-parallel ones reduce-scatter back to it.
Selective recompute (--recompute-granularity selective) recomputes the attention core
(scores, softmax, dropout, x V) in backward; full recompute runs whole layers under
checkpoint (model/recompute.py).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, set_sequence_parallel_parameters
from megatron_lite.parallel.random import (
    checkpoint,
    get_rng_tracker,
    layer_rng,
    layer_sequence_shard_rng,
    layer_split_rng,
)
from megatron_lite.parallel.tp import tp_world_size


def normal_init(std: float):
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def scaled_normal_init(std: float, num_layers: int):
    """Output projections of residual branches: std / sqrt(2 L), as in GPT-2 and Megatron-LM."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer) applied to queries and keys, positions 0..s-1."""

    def __init__(self, head_dim: int, base: int):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        # x: [b, np, s, hd] at positions offset..offset+s-1
        s = x.shape[2]
        positions = torch.arange(offset, offset + s, device=x.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)  # [s, hd/2]
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(x.dtype)
        sin = torch.cat((freqs, freqs), dim=-1).sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# What `--attention-backend auto` takes per kind of device; the one place that rule lives.
#   cpu:  sdpa, measured faster in whole training steps (tools/bench_training.py --part single,
#         README "Benchmarks").
#   cuda: fused, NOT measured yet: scripts/gpu_check.sh step b times whole causal attention (our
#         fused softmax between two matmuls vs SDPA) for fp16/bf16 at s = 512..8192, names the
#         winner, and fails while this entry disagrees with it; its report is the table to cite here.
AUTO_ATTENTION_BACKEND = {"cpu": "sdpa", "cuda": "fused"}


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
        self.head_dim = h // heads
        self.local_heads = heads // tp_world_size()
        # stride=3: the master [3h, h] weight is [Q; K; V]; each rank takes whole heads of each.
        self.query_key_value = ColumnParallelLinear(h, 3 * h, init_method=normal_init(config.init_method_std), stride=3,
                                                    sequence_parallel=sequence_parallel)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = resolve_attention_backend(config.attention_backend)
        self.softmax = FusedScaleMaskSoftmax(
            attn_mask_type="causal", scale=self.scale,
            softmax_in_fp32=config.attention_softmax_in_fp32, fusion=config.masked_softmax_fusion,
        )
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.dropout_rng = layer_split_rng(layer_number)
        self.rotary = (RotaryEmbedding(self.head_dim, config.rotary_base)
                       if config.position_embedding_type == "rope" else None)
        self.dense = RowParallelLinear(h, h, input_is_parallel=True,
                                       init_method=scaled_normal_init(config.init_method_std, config.num_layers),
                                       sequence_parallel=sequence_parallel)
        self.recompute_core = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """kv_cache (generation only): an object with `offset` (tokens already cached) and
        `append(k, v) -> (all keys, all values)`; x then holds the tokens after those."""
        offset = 0 if kv_cache is None else kv_cache.offset
        qkv = self.query_key_value(x)  # [b, s, h] (sequence parallel: [b, s/tp, h]) -> [b, s, 3h/tp]
        b, s, _ = qkv.shape
        q, k, v = qkv.split(self.local_heads * self.head_dim, dim=-1)

        def heads(t):  # [b, s, np*hd] -> [b, np, s, hd]
            return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [b, np, offset + s, hd]
        if self.recompute_core and kv_cache is None and torch.is_grad_enabled():
            # Only q, k, v (views of qkv) and the context are kept; the [b, np, s, s] scores,
            # probabilities and dropout mask are made again in backward, with the same mask.
            context = checkpoint(self._core, q, k, v)
        else:
            context = self._core(q, k, v, offset)
        context = context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, h/tp]
        return self.dense(context)  # [b, s, h] reduced over TP (sequence parallel: [b, s/tp, h])

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Scores, causal softmax, dropout, x V: [b, np, s, hd] -> [b, np, s, hd]."""
        # Heads are split across TP ranks, so their dropout masks must differ per rank.
        with get_rng_tracker().fork(self.dropout_rng):
            if offset:
                # Decoding after cached tokens: scores are [s, offset + s], not the square causal case
                # that SDPA's is_causal and the fused kernel handle.
                scores = torch.matmul(q, k.transpose(-2, -1))  # [b, np, s, offset + s]
                probs = self.attention_dropout(self._softmax_after_cache(scores, offset))
                return torch.matmul(probs, v)  # [b, np, s, hd]
            if self.backend == "sdpa":
                # One kernel for scores, causal softmax, dropout and values; its dropout draws from
                # the stream forked above like nn.Dropout would.
                p = self.attention_dropout.p if self.training else 0.0
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.scale)
            scores = torch.matmul(q, k.transpose(-2, -1))  # [b, np, s, s]
            probs = self.attention_dropout(self.softmax(scores))
            return torch.matmul(probs, v)  # [b, np, s, hd]

    def _softmax_after_cache(self, scores: torch.Tensor, offset: int) -> torch.Tensor:
        """Causal softmax for queries at positions offset.. over keys 0..offset+s-1 (not square, so
        not the fused kernel's case)."""
        s, keys = scores.shape[-2], scores.shape[-1]
        future = torch.ones(s, keys, dtype=torch.bool, device=scores.device).triu(offset + 1)
        probs = torch.softmax(scores.float().masked_fill(future, float("-inf")) / math.sqrt(self.head_dim), dim=-1)
        return probs.to(scores.dtype)


class ParallelMLP(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool = False):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size,
                                                  init_method=normal_init(config.init_method_std),
                                                  sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=scaled_normal_init(config.init_method_std, config.num_layers),
            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, h] -> [b, s, ffn/tp] -> [b, s, h]  (sequence parallel: [b, s/tp, h] in and out)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


def sequence_parallel_layer_norm(hidden_size: int, eps: float, sequence_parallel: bool) -> nn.LayerNorm:
    """A LayerNorm; under sequence parallelism it sees this rank's shard, so its parameters are tagged."""
    norm = nn.LayerNorm(hidden_size, eps=eps)
    if sequence_parallel:
        set_sequence_parallel_parameters(norm)
    return norm


class TransformerLayer(nn.Module):
    """x + dropout(attention(LN(x))), then x + dropout(MLP(LN(x))).

    layer_number counts from 1 over the whole model and names the layer's dropout streams.
    """

    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = sequence_parallel_layer_norm(h, eps, sequence_parallel)
        self.attention = ParallelAttention(config, layer_number, sequence_parallel)
        self.post_attention_layernorm = sequence_parallel_layer_norm(h, eps, sequence_parallel)
        self.mlp = ParallelMLP(config, sequence_parallel)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        # Replicated residual stream: one stream seeded alike on every TP rank keeps the replicas equal.
        # Sequence parallel: each TP rank holds other positions, so each draws from its own stream.
        self.dropout_rng = layer_sequence_shard_rng(layer_number) if sequence_parallel else layer_rng(layer_number)

    def _residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork(self.dropout_rng):
            return x + self.hidden_dropout(branch)

    def forward(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        x = self._residual(x, self.attention(self.input_layernorm(x), kv_cache))
        return self._residual(x, self.mlp(self.post_attention_layernorm(x)))
