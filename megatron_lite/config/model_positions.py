"""ModelConfig's position sections: the kind of positions (learned or rotary) and rotary frequency scaling
(Llama 3.1's, YaRN's; partial RoPE). `model.py` assembles them; model/rotary.py computes from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config.option import option


@dataclass(frozen=True)
class PositionConfig:
    """Learned absolute or rotary positions."""
    position_embedding_type: str = option("learned_absolute", "--position-embedding-type",
                                          choices=("learned_absolute", "rope", "yarn"))
    """Learned absolute positions (GPT-2) or rotary embeddings; yarn: rotary with YaRN's scaling (the same as
    rope with --rope-type yarn, which validation makes it)."""
    rotary_base: int = option(10000, "--rotary-base", minimum=1)
    """Base of the rotary frequencies."""


@dataclass(frozen=True)
class RopeScalingConfig:
    """Scaling of the rotary frequencies for long contexts."""
    use_rope_scaling: bool = option(False, "--use-rope-scaling")
    """Llama 3.1's rotary frequency scaling (low/high-frequency factors 1 and 4, original context 8192)."""
    rope_scaling_factor: float = option(8.0, "--rope-scaling-factor", minimum=1, maximum=1024)
    """With --use-rope-scaling: the factor long wavelengths are divided by."""
    rope_type: str = option("rope", "--rope-type", choices=("rope", "yarn"))
    """Rotary frequencies: plain (or Llama 3.1's with --use-rope-scaling), or YaRN's (--rotary-scaling-factor,
    --yarn-*, --mscale, --mscale-all-dim): interpolated long wavelengths, kept short ones, a ramp between, and
    cos/sin times the concentration factor."""
    rotary_scaling_factor: float = option(1.0, "--rotary-scaling-factor", minimum=1, maximum=1024)
    """YaRN's context extension factor s (1: YaRN is plain RoPE)."""
    yarn_original_max_position_embeddings: Optional[int] = option(
        None, "--yarn-original-max-position-embeddings", minimum=1)
    """YaRN: the context the model was trained at before the extension (DeepSeek-V3 and gpt-oss: 4096); needed
    with --rotary-scaling-factor above 1."""
    yarn_beta_fast: float = option(32.0, "--yarn-beta-fast", above=0, maximum=1e6)
    """YaRN: rotations over the original context above which a frequency is kept (extrapolated)."""
    yarn_beta_slow: float = option(1.0, "--yarn-beta-slow", above=0, maximum=1e6)
    """YaRN: rotations over the original context below which a frequency is divided by the factor (Kimi K2: 1 and 1)."""
    yarn_correction_range_round_to_int: bool = option(True, "--yarn-correction-range-round-to-int",
                                                      action="boolean_optional")
    """YaRN: round the ramp's ends to whole dimensions (transformers' truncate; gpt-oss:
    --no-yarn-correction-range-round-to-int)."""
    mscale: float = option(1.0, "--mscale", minimum=0, maximum=1e6)
    """YaRN's concentration: cos and sin are multiplied by (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)
    when both are non-zero, else by 0.1 ln s + 1."""
    mscale_all_dim: float = option(0.0, "--mscale-all-dim", minimum=0, maximum=1e6)
    """YaRN: the denominator's mscale in the concentration factor (--mscale)."""
    rotary_percent: float = option(1.0, "--rotary-percent", above=0, maximum=1)
    """The share of each head's dimensions RoPE turns (the first ones; GLM-4.5: 0.5); the rest pass unrotated."""
