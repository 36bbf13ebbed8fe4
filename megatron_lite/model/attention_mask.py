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

from megatron_lite.config import ModelConfig


def needs_document_ids(model: ModelConfig) -> bool:
    """Whether samples carry document ids to every stage: the mask needs them, and so do rotary positions
    that restart per document (learned positions are looked up once, from the data's position ids)."""
    return model.reset_attention_mask or (model.reset_position_ids and model.position_embedding_type == "rope")


def layer_window(model: ModelConfig, layer_number: int) -> Optional[int]:
    """The left extent L of layer `layer_number`'s window (counted from 1), or None for global attention."""
    if model.window_size is None:
        return None
    every = model.window_attn_skip_freq
    if every is not None and layer_number % every == 0:
        return None
    return model.window_size[0]


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


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, s] positions, 0 at each document's first token (data/documents.py's rule,
    on the tensors a stage holds)."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = torch.where(first, index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=-1).values
