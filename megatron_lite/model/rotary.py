"""Rotary position embedding (RoPE) and its frequency scalings: Llama 3.1's today; the place for YaRN and
partial RoPE."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn


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
