"""Where the documents packed into a sample begin: the document index of each token, and positions that
restart with each document (--reset-attention-mask, --reset-position-ids).

A sample is a window of concatenated documents, each closed by an end-of-document token. As in
Megatron-LM, the end-of-document token belongs to the document it closes, and the token after it starts
the next one: document_ids[t] counts the end-of-document tokens before t. Those ids are all the model needs
(model/attention_mask.py): a token attends to the keys of its own document, and its rotary position is its
distance from the document's first token. They cross pipeline stages as one int32 [b, s] tensor, whole
under context parallelism (data/context_parallel.py), because after the all-to-all a rank attends over the
whole sequence.
"""
from __future__ import annotations

import numpy as np


def document_ids(tokens: np.ndarray, eod_token: int) -> np.ndarray:
    """[s] tokens -> [s] int32: 0 for the first document's tokens (its end-of-document token included), 1 for
    the next, ..."""
    ends = (tokens == eod_token).astype(np.int32)
    ids = np.zeros(len(tokens), dtype=np.int32)
    np.cumsum(ends[:-1], out=ids[1:])
    return ids


def positions_in_documents(ids: np.ndarray) -> np.ndarray:
    """[s] document ids -> [s] int64 positions, 0 at each document's first token."""
    index = np.arange(len(ids), dtype=np.int64)
    starts = np.where(np.r_[True, ids[1:] != ids[:-1]], index, 0)
    return index - np.maximum.accumulate(starts)
