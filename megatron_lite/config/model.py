"""ModelConfig: the model's flags, one flat dataclass assembled from the sections in model_*.py.

Dataclass fields come in reverse MRO order, base by base, so the bases are listed last section first:
`dataclasses.fields(ModelConfig)` (the order of the parser and of --help) runs shape, positions, block,
attention heads, latent attention, biases, RoPE scaling, recompute, attention kernel, MoE, multi-token
prediction, compile. A new field goes at the end of its section's class (the flag then shows there in --help);
`config.model.<field>` stays flat."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.model_attention import AttentionHeadsConfig, AttentionKernelConfig, LatentAttentionConfig
from megatron_lite.config.model_core import (
    BiasConfig,
    BlockConfig,
    CompileConfig,
    MultiTokenPredictionConfig,
    RecomputeConfig,
    ShapeConfig,
)
from megatron_lite.config.model_moe import MoEConfig
from megatron_lite.config.model_positions import PositionConfig, RopeScalingConfig


@dataclass(frozen=True)
class ModelConfig(CompileConfig, MultiTokenPredictionConfig, MoEConfig, AttentionKernelConfig, RecomputeConfig, RopeScalingConfig, BiasConfig,
                  LatentAttentionConfig, AttentionHeadsConfig, BlockConfig, PositionConfig, ShapeConfig):
    @property
    def head_dim(self) -> int:
        """Width of one query/key head: --kv-channels, or --hidden-size / --num-attention-heads when not given;
        with --multi-latent-attention --qk-head-dim + --qk-pos-emb-head-dim."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: the query/key width, or --v-head-dim with --multi-latent-attention."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE turns: --rotary-percent of the head width (all of it by default); with
        --multi-latent-attention the --qk-pos-emb-head-dim ones."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def numbered_layers(self) -> int:
        """Decoder layers with a layer number (dropout streams, MoE layer numbers): --num-layers, then the
        --mtp-num-layers depths' (numbered after them)."""
        return self.num_layers + (self.mtp_num_layers or 0)

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP (and each expert) is gated: [gate; up] halves, --swiglu or --quick-geglu."""
        return self.swiglu or self.quick_geglu

    @property
    def attention_sinks(self) -> bool:
        """Whether the attention softmax has a sink logit per head (--softmax-type off-by-one or learnable)."""
        return self.softmax_type != "vanilla"

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV linear has a bias: every linear's (no --disable-bias-linear), or --add-qkv-bias."""
        return self.add_bias_linear or self.add_qkv_bias
