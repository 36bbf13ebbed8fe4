"""Autoregressive decoding with the dense `GPTModel`, with or without a KV cache.

With the cache, the prompt is run once and each new token attends to the
cached keys and values of everything before it; without it, the whole
sequence is run again for every token (the reference the cache must match).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_lite.config import Config
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.inference.sampling import sample
from megatron_lite.model.gpt import GPTModel


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    use_kv_cache: bool = True
    stop_token: Optional[int] = None
    """Stop a sequence after it produces this token (the end-of-document id)."""


def forward_tokens(model: GPTModel, config: Config, tokens: torch.Tensor, offset: int,
                   caches: Optional[List[KVCache]]) -> torch.Tensor:
    """Logits [b, s, V] of tokens [b, s] that sit at positions offset..offset+s-1."""
    n = config.model.num_layers
    positions = torch.arange(offset, offset + tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    embedding = model.layers[0]
    x = embedding((tokens, positions))
    for i in range(n):
        x = model.layers[1 + i](x, kv_cache=None if caches is None else caches[i])
    x = model.layers[n + 1](x)
    if config.model.untie_embeddings_and_output_weights:
        return model.layers[n + 2](x)
    return embedding.logits(x)


@torch.no_grad()
def generate(model: GPTModel, config: Config, prompt: Sequence[int], options: SamplingOptions) -> List[int]:
    """The prompt's continuation: up to max_new_tokens ids (fewer if stop_token comes)."""
    model.eval()
    limit = config.model.max_position_embeddings if config.model.position_embedding_type == "learned_absolute" else None
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    if limit is not None and len(prompt) + options.max_new_tokens > limit:
        raise ValueError(f"--max-new-tokens {options.max_new_tokens} with a {len(prompt)}-token prompt passes the "
                         f"model's {limit} positions; use --max-new-tokens {max(limit - len(prompt), 0)} or less")
    vocab = config.model.vocab_size or config.model.padded_vocab_size
    generator = torch.Generator().manual_seed(options.seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long)
    caches = [KVCache() for _ in range(config.model.num_layers)] if options.use_kv_cache else None
    new: List[int] = []
    step_input, offset = tokens, 0
    for _ in range(options.max_new_tokens):
        logits = forward_tokens(model, config, step_input, offset, caches)[:, -1, :].float()
        logits[:, vocab:] = float("-inf")  # padded rows are never a token
        next_id = sample(logits, options.temperature, options.top_k, options.top_p, generator)
        new.append(int(next_id.item()))
        if options.stop_token is not None and new[-1] == options.stop_token:
            break
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
        if caches is None:
            step_input = tokens
        else:
            step_input, offset = next_id.view(1, 1), tokens.shape[1] - 1
    return new
