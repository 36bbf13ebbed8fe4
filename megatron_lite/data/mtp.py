"""What Multi-Token Prediction's depths read (model/mtp.py): for depth k = 1..D, the token k ahead of each position
(its input, embedded), the label k ahead (its target: the token k + 1 ahead) and the loss mask k ahead.

Made from a micro-batch's whole sequences before the context-parallel split, so every CP rank gets its part of
the same arrays (and loss weights over the whole micro-batch: data/context_parallel.py), as Megatron-LM's
roll_tensor does with a p2p exchange. Position i at depth k is valid when i + k is in the sequence and, with
document ids (--reset-attention-mask / --reset-position-ids), in i's document (Megatron-LM rolls packed
sequences per document); an invalid position gets token 0, label 0 and mask 0. Works on numpy arrays (the data
pipeline) and torch tensors (tests) alike.
"""
from __future__ import annotations

from typing import Optional, Tuple


def mtp_arrays(tokens, labels, loss_mask, documents: Optional = None, depths: int = 1) -> Tuple:
    """tokens, labels, loss_mask [micro, seq] (and document ids [micro, seq]) -> the depths' tokens, labels and
    mask, each [micro, D, seq]."""
    stack, zeros_like, ones_like = _ops(tokens)  # depths < seq (validation)
    out_tokens, out_labels, out_mask = [], [], []
    for k in range(1, depths + 1):
        shifted = [_shift(a, k, zeros_like) for a in (tokens, labels, loss_mask)]
        valid = _shift(ones_like(tokens), k, zeros_like) > 0  # i + k inside the sequence
        if documents is not None:
            valid = valid & (_shift(documents, k, zeros_like) == documents)
        out_tokens.append(shifted[0] * valid)
        out_labels.append(shifted[1] * valid)
        out_mask.append(shifted[2] * valid)
    return stack(out_tokens), stack(out_labels), stack(out_mask)


def _shift(a, k: int, zeros_like):
    """a[:, i + k] at position i; zeros past the end."""
    out = zeros_like(a)
    out[:, :a.shape[1] - k] = a[:, k:]
    return out


def _ops(example):
    if hasattr(example, "numpy"):  # a torch tensor
        import torch

        return (lambda xs: torch.stack(xs, dim=1)), torch.zeros_like, torch.ones_like
    import numpy as np

    return (lambda xs: np.stack(xs, axis=1)), np.zeros_like, np.ones_like
