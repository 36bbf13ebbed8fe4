"""Attention sinks (--softmax-type off-by-one / learnable, gpt-oss): one logit per head in every softmax row's
denominator, taking probability mass and giving no value,

    p_ij = exp(scale q_i.k_j) / (exp(sink_h) + sum_j' exp(scale q_i.k_j')).

The eager and fused paths put the sink into the softmax (model/fused_softmax.py). SDPA has no sink argument, and the
post-hoc form `out x sigmoid(lse - sink)` needs a log-sum-exp with a gradient, which torch's SDPA does not return.
So the sink becomes one more key that every query sees, with a zero value: each query gets one more dimension holding
sink_h / scale, the sink key is 1 there and 0 elsewhere, real keys 0 there, so its score is exactly sink_h and the
real scores are unchanged. SDPA's own backward then gives exact gradients for q, k, v, and for the sinks through
that column (a float64 gradcheck: tests/model/test_attention_sinks.py). The price: the head is padded to the next
multiple of 8 (CUDA kernels want it), one more key, and an explicit mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
                    sinks: torch.Tensor, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """q [b, np, s, hd], k [b, ng, s', hd], v [b, ng, s', hd_v] (ng dividing np, a group's heads adjacent),
    allowed: bool [b or 1, 1, s, s'] True where a query may attend a key, or None for causal (aligned at the
    bottom right, as with cached keys); sinks [np] -> [b, np, s, hd_v]."""
    b, heads, s, hd = q.shape
    groups, keys, value_width = k.shape[1], k.shape[2], v.shape[-1]
    width = -(-(max(hd, value_width) + 1) // 8) * 8
    column = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, s, 1)
    q = torch.cat([q, column, q.new_zeros(b, heads, s, width - hd - 1)], dim=-1)
    sink_key = k.new_zeros(1, 1, 1, width)
    sink_key[..., hd] = 1.0
    k = torch.cat([F.pad(k, (0, width - hd)), sink_key.expand(b, groups, 1, width)], dim=2)
    v = torch.cat([F.pad(v, (0, width - value_width)), v.new_zeros(b, groups, 1, width)], dim=2)
    if allowed is None:
        allowed = torch.ones(s, keys, dtype=torch.bool, device=q.device).tril(keys - s).view(1, 1, s, keys)
    allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:-1], 1)], dim=-1)  # the sink: seen by all
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=groups != heads)
    return out[..., :value_width]
