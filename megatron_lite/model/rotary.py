"""Rotary position embedding (RoPE) and its frequency scalings: Llama 3.1's and YaRN's; partial RoPE.

RoPE turns the first r = --rotary-percent x d dimensions of each query and key head (all d by default) by
angles position x inv_freq[i], rotate-half style (pairs i and i + r/2, as Llama and transformers do); the
rest pass unchanged. `rotary_frequencies` is the one place that turns the model's flags into inv_freq and
the factor cos and sin are multiplied by:
  rope            inv_freq[i] = base^(-2i/r), factor 1; with --use-rope-scaling Llama 3.1's band scaling
  yarn (YaRN)     inv_freq blends base^(-2i/r) (kept: the fast dimensions) and base^(-2i/r) / s (interpolated:
                  the slow ones) over a ramp between the dimensions where a wavelength makes beta_fast and
                  beta_slow turns over the original context L0: dim(b) = r ln(L0 / (2 pi b)) / (2 ln base),
                  rounded outwards unless --no-yarn-correction-range-round-to-int, clamped to [0, r - 1];
                  factor = m(s, mscale) / m(s, mscale_all_dim) when both are non-zero, else m(s, 1), with
                  m(s, k) = 0.1 k ln s + 1 (1 for s <= 1)
as transformers' `_compute_yarn_parameters` and Megatron-LM's YarnRotaryEmbedding compute them
(tests/model/test_rotary.py holds us to transformers').
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from megatron_lite.config import ModelConfig

# Llama 3.1's RoPE scaling constants (its params.json; transformers' rope_type "llama3"): wavelengths
# shorter than ORIGINAL / HIGH are kept, longer than ORIGINAL / LOW divided by the factor, and the band
# between blended.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """Plain RoPE's inverse frequencies base^(-2i/dim) for i < dim/2 (fp32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's m(s, k) = 0.1 k ln s + 1 (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """What YaRN multiplies cos and sin by (module docstring)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(scale, mscale) / yarn_mscale(scale, mscale_all_dim)
    return yarn_mscale(scale)


def yarn_correction_range(dim: int, base: float, original: int, beta_fast: float, beta_slow: float,
                          round_to_int: bool) -> Tuple[float, float]:
    """The dimensions where YaRN's ramp starts (beta_fast turns over `original` positions) and ends (beta_slow)."""
    def dimension(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_frequencies(dim: int, base: float, scale: float, original: int, beta_fast: float, beta_slow: float,
                     round_to_int: bool = True) -> torch.Tensor:
    """YaRN's inverse frequencies for a rotary width `dim` (fp32; module docstring)."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kept, interpolated = 1.0 / powers, 1.0 / (scale * powers)
    low, high = yarn_correction_range(dim, base, original, beta_fast, beta_slow, round_to_int)
    if low == high:
        high += 0.001  # a ramp of no width: a step at `low`
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolated * ramp + kept * (1 - ramp)


def yarn_original_context(model: ModelConfig) -> int:
    """YaRN's L0: --yarn-original-max-position-embeddings, which validation requires at s > 1; at s = 1 (where L0
    changes nothing) the model's positions stand in, so a config without it still names one."""
    return model.yarn_original_max_position_embeddings or model.max_position_embeddings or model.seq_length


def mla_softmax_mscale(model: ModelConfig) -> float:
    """m in Multi-head Latent Attention's softmax scale m^2 / sqrt(d_qk): YaRN's m(s, --mscale-all-dim) under
    --rope-type yarn with a non-zero --mscale-all-dim, else 1 (transformers' yarn_apply_mscale; Megatron-LM
    #1429 took --mscale here). It scales every query/key dimension, the unrotated ones too."""
    if model.rope_type != "yarn" or not model.mscale_all_dim:
        return 1.0
    return yarn_mscale(model.rotary_scaling_factor, model.mscale_all_dim)


def rotary_frequencies(model: ModelConfig) -> Tuple[torch.Tensor, float]:
    """(inv_freq [r/2], the factor on cos and sin) for this model's rotary positions."""
    r = model.rotary_dim
    if model.rope_type == "yarn":
        inv_freq = yarn_frequencies(r, model.rotary_base, model.rotary_scaling_factor, yarn_original_context(model),
                                    model.yarn_beta_fast, model.yarn_beta_slow, model.yarn_correction_range_round_to_int)
        return inv_freq, yarn_attention_factor(model.rotary_scaling_factor, model.mscale, model.mscale_all_dim)
    inv_freq = inverse_frequencies(r, model.rotary_base)
    if model.use_rope_scaling:
        inv_freq = llama3_scaled_frequencies(inv_freq, model.rope_scaling_factor)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, rotate-half as in Llama) on queries and keys, positions
    offset..offset+s-1, with `inv_freq` [r/2] turning each head's first r dimensions and cos and sin
    multiplied by `attention_factor` (YaRN's concentration)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor

    @classmethod
    def of(cls, model: ModelConfig) -> "RotaryEmbedding":
        return cls(*rotary_frequencies(model))

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        # q [b, np, s, hd] and k [b, ng, s, hd] at positions offset..offset+s-1 (one cos/sin table), or at
        # `positions` [b, s] (positions restarting per document: a table per sample, [b, 1, s, hd])
        s, half = q.shape[2], self.inv_freq.numel()
        if positions is None:
            positions = torch.arange(offset, offset + s, device=q.device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)  # [s, r/2]; both halves of a head turn by these angles
        else:
            freqs = (positions.to(torch.float32)[..., None] * self.inv_freq)[:, None]  # [b, 1, s, r/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # in fp32, as transformers scales its tables
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos = cos.to(q.dtype)
        cos = torch.cat((cos, cos), dim=-1)  # [.., s, r]
        sin = sin.to(q.dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        # Rotate-half, x cos + [-x2, x1] sin, written as x cos + roll(x, r/2) [-sin, sin]: the same products,
        # without negating and concatenating x's halves (and, in backward, their gradients).
        if 2 * half == q.shape[3]:
            return tuple(x * cos + x.roll(half, dims=-1) * signed_sin for x in (q, k))
        # Partial RoPE: the first r dimensions turn, the rest pass (views, joined again).
        return tuple(torch.cat((x[..., :2 * half] * cos + x[..., :2 * half].roll(half, dims=-1) * signed_sin,
                                x[..., 2 * half:]), dim=-1) for x in (q, k))
