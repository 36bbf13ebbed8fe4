"""The two normalisations a layer can use: LayerNorm (GPT-2) and RMSNorm (Llama), picked by --normalization.

Under sequence parallelism a norm sees only this TP rank's part of the sequence, so its parameters
are tagged: their gradients are summed over TP once per step (parallel/sequence_parallel.py).
QK-norm's (--qk-layernorm) work on one head's width and are shared by every head, of which a TP rank
holds its own: tagged likewise.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.parallel.layers import set_head_shared_parameters, set_sequence_parallel_parameters


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back before the weight, as
    transformers' LlamaRMSNorm and Megatron-LM do (where eps sits changes the result: inside the root)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(config: ModelConfig, size: int) -> nn.Module:
    if config.normalization == "RMSNorm":
        return RMSNorm(size, config.norm_epsilon)
    return nn.LayerNorm(size, eps=config.norm_epsilon)


def build_norm(config: ModelConfig, sequence_parallel: bool, size: Optional[int] = None) -> nn.Module:
    """The config's norm over the hidden size (or `size`: MLA's latents, model/latent_attention.py); tagged when it
    works on sequence shards."""
    norm = _norm(config, size or config.hidden_size)
    if sequence_parallel:
        set_sequence_parallel_parameters(norm)
    return norm


def build_head_norm(config: ModelConfig) -> nn.Module:
    """QK-norm: the config's norm over one head's width (--kv-channels), applied to every query (or key) head
    of this rank; tagged, its gradient being summed over TP."""
    norm = _norm(config, config.head_dim)
    set_head_shared_parameters(norm)
    return norm

