"""Which keys a query may attend to beyond causality: its own document (--reset-attention-mask) and the
sliding window (--window-size, --window-attn-skip-freq); and rotary positions that restart per document
(--reset-position-ids).

The documents of a sample arrive as each token's document index (data/documents.py: the end-of-document
token closes its document) and cross pipeline stages with the hidden states only when some layer needs
them (`needs_document_ids`): a plain causal run sends nothing more than before. The mask is built where
attention runs, after the context-parallel all-to-all, over the whole sequence:

    allowed[b, 0, i, j] = j <= i  and  i - j <= L (a windowed layer)  and  document[b, i] == document[b, j]

as a bool [b or 1, 1, s, s], True = attend (SDPA's convention; the fused softmax takes its negation). Every
row keeps at least its own token, so no row is empty. Megatron-LM's window semantics: a layer numbered n
(from 1) is windowed unless --window-attn-skip-freq N divides n.
"""
from __future__ import annotations

from typing import Optional

import torch



def allowed_keys(length: int, device: torch.device, documents: Optional[torch.Tensor] = None,
                 window: Optional[int] = None) -> torch.Tensor:
    """bool [b or 1, 1, length, length]: query i may attend key j (causal, within `window` tokens before i,
    in i's document when `documents` [b, length] is given)."""
    index = torch.arange(length, device=device)
    behind = index[:, None] - index[None, :]  # i - j
    allowed = behind >= 0
    if window is not None:
        allowed &= behind <= window
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    return allowed


def _first_tokens(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> bool [b, s], True at each document's first token."""
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return first


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, s] positions, 0 at each document's first token (data/documents.py's rule,
    on the tensors a stage holds)."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.where(_first_tokens(documents), index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=-1).values


SEGMENTS_PER_TOKEN = 1 / 32
"""Attention runs document by document (causal within each, blocks between documents skipped) while a
micro-batch holds at most this many documents per token, else over the whole sequence with the mask.
Measured on CPU (2 threads, SDPA, b 2 x s 1024, 4 heads of 64, forward + backward): 8 documents per
sample 25 ms by document against 67 ms masked and 45-50 ms plain causal; 32 per sample 38 against 67;
128 per sample 119 against 68 (each document is a kernel call of its own: about 0.4 ms here)."""


def document_segments(documents: torch.Tensor) -> Optional[list]:
    """[b, s] document ids -> per sample, the [start, end) token ranges of its documents; None when there
    are too many for document-by-document attention to pay (SEGMENTS_PER_TOKEN)."""
    b, s = documents.shape
    starts = _first_tokens(documents)
    if int(starts.sum()) > b * s * SEGMENTS_PER_TOKEN:
        return None
    rows = []
    for row in starts:
        first = row.nonzero().flatten().tolist()
        rows.append(list(zip(first, first[1:] + [s])))
    return rows


class AttentionWork:
    """The share of full attention a rank has computed since it was last asked: 1 over the whole sequence
    (plain causal, or through a mask: every block computed), the documents' own sum of squared lengths
    over S^2 per sample when attending document by document. The training loop scales the attention
    FLOPs it reports (TFLOP/s, MFU) by it, so skipped blocks are not counted as work."""

    def __init__(self) -> None:
        self.computed, self.full = 0, 0

    def record(self, computed: int, full: int) -> None:
        self.computed += computed
        self.full += full

    def take(self) -> float:
        share = self.computed / self.full if self.full else 1.0
        self.computed, self.full = 0, 0
        return share


ATTENTION_WORK = AttentionWork()
