"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus), with a seeded generator."""
from __future__ import annotations

from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[b, V] logits -> [b] token ids. temperature 0 is greedy (argmax)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    # A temperature so small that logits / temperature overflows float32 (1e-300 is 0 in float32) leaves inf - inf
    # = nan in the softmax: such a row takes its limit as the temperature goes to 0, the most likely token.
    # (-inf is a masked entry, e.g. the padded vocabulary: not an overflow unless the whole row is)
    overflow = ((torch.isposinf(scaled) | torch.isnan(scaled)).any(dim=-1, keepdim=True)
                | torch.isneginf(scaled).all(dim=-1, keepdim=True))
    if overflow.any():
        top = logits.float() == logits.float().max(dim=-1, keepdim=True).values
        scaled = torch.where(overflow, torch.where(top, 0.0, float("-inf")), scaled)
    logits = scaled
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the ones before it already reach top_p (the most likely one always stays)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
