"""Which layers and samples need more than the causal mask: torch-free, so the estimate, the data
pipeline's caller and validation can ask without starting torch (the masks themselves:
model/attention_mask.py)."""
from __future__ import annotations

from typing import Optional

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
