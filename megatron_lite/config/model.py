"""ModelConfig: the model's flags, one flat dataclass assembled from the sections in model_*.py.

Dataclass fields come in reverse MRO order, base by base, so the bases are listed last section first:
`dataclasses.fields(ModelConfig)` (the order of the parser and of --help) runs shape, positions, block,
attention heads, biases, RoPE scaling, recompute, attention kernel, MoE. A new field goes at the end of
its section's class (the flag then shows there in --help); `config.model.<field>` stays flat."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.model_attention import AttentionHeadsConfig, AttentionKernelConfig
from megatron_lite.config.model_core import BiasConfig, BlockConfig, RecomputeConfig, ShapeConfig
from megatron_lite.config.model_moe import MoEConfig
from megatron_lite.config.model_positions import PositionConfig, RopeScalingConfig


@dataclass(frozen=True)
class ModelConfig(MoEConfig, AttentionKernelConfig, RecomputeConfig, RopeScalingConfig, BiasConfig,
                  AttentionHeadsConfig, BlockConfig, PositionConfig, ShapeConfig):
    @property
    def head_dim(self) -> int:
        """Width of one attention head: --kv-channels, or --hidden-size / --num-attention-heads when not given."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE turns: --rotary-percent of the head width (all of it by default)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV linear has a bias: every linear's (no --disable-bias-linear), or --add-qkv-bias."""
        return self.add_bias_linear or self.add_qkv_bias
