"""Pre-norm GPT transformer layer on tensor-parallel building blocks: GPT-2's block (LayerNorm, GeLU
MLP, biases, multi-head attention) or the Llama family's (RMSNorm, SwiGLU, grouped-query attention, no
biases, or Qwen2's on the QKV linear alone, RoPE with Llama 3.1 scaling), as the model flags say.
The attention: model/attention.py, or model/latent_attention.py (MLA) (positions: model/rotary.py); the MLP:
model/mlp.py, or an MoE layer (model/moe.py) where model/moe_options.py says.

Activations are [b, s, h] (batch first). Heads and the MLP's inner width are
split across TP ranks by the Column/Row parallel layers; this file calls no
process-group function itself. Layer N's dropouts draw from its own streams
(parallel/random.py), so its masks do not depend on which pipeline stage runs it.

With sequence_parallel (--sequence-parallel) the residual stream, the LayerNorms and
the residual dropout work on this TP rank's part of the sequence, [b, s/tp, h]: the
column-parallel linears all-gather it, the row-parallel ones reduce-scatter back to it.
With context parallelism (--context-parallel-size C) every activation outside attention holds this
CP rank's s/C tokens (attention's own split: model/attention.py).
Full recompute runs whole layers under checkpoint (model/recompute.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention import ParallelAttention
from megatron_lite.model.attention_options import needs_document_ids
from megatron_lite.model.latent_attention import MultiLatentAttention
from megatron_lite.model.mlp import ParallelMLP
from megatron_lite.model.moe import MoELayer
from megatron_lite.model.moe_options import is_moe_layer
from megatron_lite.model.norms import build_norm
from megatron_lite.parallel.random import dropout_draws, layer_rng, layer_sequence_shard_rng, run_in_stream


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(MLP(norm(x))).

    layer_number counts from 1 over the whole model and names the layer's dropout streams.
    """

    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_number
        self.with_documents = needs_document_ids(config)
        self.input_layernorm = build_norm(config, sequence_parallel)
        attention = MultiLatentAttention if config.multi_latent_attention else ParallelAttention
        self.attention = attention(config, layer_number, sequence_parallel)
        self.post_attention_layernorm = build_norm(config, sequence_parallel)
        self.mlp = (MoELayer(config, sequence_parallel, layer_number) if is_moe_layer(config, layer_number)
                    else ParallelMLP(config, sequence_parallel))
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        # Replicated residual stream: one stream seeded alike on every TP rank keeps the replicas equal.
        # Sequence parallel: each TP rank holds other positions, so each draws from its own stream.
        self.dropout_rng = layer_sequence_shard_rng(layer_number) if sequence_parallel else layer_rng(layer_number)

    def _residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        if not dropout_draws(self.hidden_dropout):
            return x + branch
        return x + run_in_stream(self.dropout_rng, self.hidden_dropout, branch)

    def forward(self, x, kv_cache=None):
        """x: hidden states [b, s, h]; or (hidden states, [document ids [b, s]], [Multi-Token Prediction's tokens
        [b, D, s]]) when samples carry them, which the layer passes on to the next (what crosses pipeline
        stages; the document ids are there when the model needs them: model/attention_options.py)."""
        if isinstance(x, tuple):
            hidden, *rest = x
            documents = rest[0] if self.with_documents else None
            return (self._layer(hidden, kv_cache, documents), *rest)
        return self._layer(x, kv_cache)

    def _layer(self, x: torch.Tensor, kv_cache=None, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self._residual(x, self.attention(self.input_layernorm(x), kv_cache, documents))
        return self._residual(x, self.mlp(self.post_attention_layernorm(x)))

