"""A context-parallel rank's part of a micro-batch, with the loss weights that make CP ranks' losses add
up to the sample's.

The C ranks of one CP group read the same samples (the sampler sees only DP) and each keeps the c-th
of C equal consecutive parts of the sequence: tokens, positions (so learned position embeddings see
true positions), labels and the loss mask.

The loss of a micro-batch is the mean over all of its unmasked tokens, wherever they fall. So the
mask leaves here as a weight: mask x C / (unmasked tokens of the whole micro-batch), and the loss is
sum(per-token loss x weight) (model/gpt.py). Summed over the CP ranks that is C x the micro-batch's
masked mean; DeepSpeed averages gradients and losses over DP x CP (parallel/state.py), which divides
the C back out. A CP rank whose part is all masked (EOD masking) still weighs its tokens by the
whole micro-batch's count, not its own, so uneven masks cost nothing in exactness. No collective is
needed: the whole mask is here before it is split.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def context_parallel_part(arrays: Sequence, rank: int, size: int) -> Tuple:
    """(tokens, position_ids, labels, loss_mask), each [micro, seq] (numpy arrays or tensors) ->
    this CP rank's [micro, seq/C] of each, the mask replaced by its loss weights (float32)."""
    tokens, position_ids, labels, loss_mask = arrays
    seq = tokens.shape[1]
    if seq % size:
        raise ValueError(f"sequence of {seq} tokens does not split into {size} context-parallel parts")
    part = seq // size
    window = slice(rank * part, (rank + 1) * part)
    unmasked = max(float(loss_mask.sum()), 1.0)  # as masked_mean: an all-masked micro-batch weighs 0
    weights = loss_mask[:, window] * (size / unmasked)
    weights = weights.astype(np.float32) if isinstance(weights, np.ndarray) else weights.float()
    return tokens[:, window], position_ids[:, window], labels[:, window], weights


def mtp_context_parallel_part(mtp: Sequence, rank: int, size: int) -> Tuple:
    """Multi-Token Prediction's (tokens, labels, loss mask), each [micro, D, seq] (data/mtp.py) -> this CP rank's
    [micro, D, seq/C] of each, each depth's mask replaced by its loss weights over the whole micro-batch (as
    above, per depth: a rank whose part of a depth is all masked, a document ending at its boundary, weighs 0
    and never divides by its own zero count: Megatron-LM PR #3396's NaN)."""
    tokens, labels, loss_mask = mtp
    part = tokens.shape[-1] // size
    window = slice(rank * part, (rank + 1) * part)
    unmasked = loss_mask.sum(axis=(0, 2)) if isinstance(loss_mask, np.ndarray) else loss_mask.sum(dim=(0, 2))
    unmasked = unmasked.clip(1.0, None) if isinstance(unmasked, np.ndarray) else unmasked.clamp(min=1.0)
    weights = loss_mask[:, :, window] * (size / unmasked[None, :, None])
    weights = weights.astype(np.float32) if isinstance(weights, np.ndarray) else weights.float()
    return tokens[:, :, window], labels[:, :, window], weights
