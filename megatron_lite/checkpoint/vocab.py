"""Padded vocabulary rows: drop them, or add or remove some when TP changes the padding.

The vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP
(config.pad_vocab_size). Rows past the tokenizer's vocabulary are never a
target, so dropping or adding such rows keeps every real token's logit; their
logits do enter the softmax's denominator during training, so a resharded
run whose padding changes continues with slightly different losses.
"""
from __future__ import annotations

import torch

from megatron_lite.checkpoint.layout import VOCAB_PARAMETERS


def is_vocab_parameter(name: str) -> bool:
    return name in VOCAB_PARAMETERS


def resize_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Keep the first `rows` rows, or append zero rows up to `rows`."""
    if tensor.shape[0] >= rows:
        return tensor[:rows].clone()
    pad = torch.zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=0)
