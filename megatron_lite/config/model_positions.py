"""ModelConfig's position sections: the kind of positions (learned or rotary) and rotary frequency scaling.
`model.py` assembles them."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.option import option


@dataclass(frozen=True)
class PositionConfig:
    """Learned absolute or rotary positions."""
    position_embedding_type: str = option("learned_absolute", "--position-embedding-type",
                                          choices=("learned_absolute", "rope"))
    """Learned absolute positions (GPT-2) or rotary embeddings."""
    rotary_base: int = option(10000, "--rotary-base", minimum=1)
    """Base of the rotary frequencies."""


@dataclass(frozen=True)
class RopeScalingConfig:
    """Scaling of the rotary frequencies for long contexts."""
    use_rope_scaling: bool = option(False, "--use-rope-scaling")
    """Llama 3.1's rotary frequency scaling (low/high-frequency factors 1 and 4, original context 8192)."""
    rope_scaling_factor: float = option(8.0, "--rope-scaling-factor", minimum=1, maximum=1024)
    """With --use-rope-scaling: the factor long wavelengths are divided by."""
