"""ModelConfig's attention sections: the heads (grouped-query attention, head width, QK norm) and the
attention core (kernel, softmax, document masks, sliding window). `model.py` assembles them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron_lite.config.flag_values import format_window_size, parse_window_size
from megatron_lite.config.option import Needs, given, option

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
WINDOW = Needs("model.window_size", given, "chooses the global layers among windowed ones",
               "--window-size L (e.g. 127)")


@dataclass(frozen=True)
class AttentionHeadsConfig:
    """Key/value groups, head width and the query/key norm."""
    group_query_attention: bool = option(False, "--group-query-attention")
    """Grouped-query attention: --num-query-groups key/value heads, each shared by a group of query heads."""
    num_query_groups: Optional[int] = option(None, "--num-query-groups", minimum=1)
    """Key/value heads with --group-query-attention (1 = multi-query attention); otherwise one per attention
    head (filled by validation)."""
    kv_channels: Optional[int] = option(None, "--kv-channels", minimum=1)
    """Width of each attention head (queries, keys and values alike), apart from --hidden-size: attention
    projects h -> heads x this and back (Qwen3's and Gemma's head_dim); when not given, --hidden-size /
    --num-attention-heads."""
    qk_layernorm: bool = option(False, "--qk-layernorm")
    """Normalise every query and key head after the QKV projection and before RoPE, as Qwen3 does: the
    --normalization kind over the head's --kv-channels, one weight (and bias) shared by all heads, with
    --norm-epsilon."""


@dataclass(frozen=True)
class AttentionKernelConfig:
    """The attention kernel, its softmax, document masks and sliding window."""
    attention_backend: str = option("auto", "--attention-backend", choices=("auto", "sdpa", "fused"))
    """Attention kernel: sdpa (torch's scaled_dot_product_attention), fused (our fused scaled-masked
    causal softmax between two matmuls), or auto: SDPA, measured faster on CPU and taken on CUDA until
    the GPU check measures otherwise (model/attention.py AUTO_ATTENTION_BACKEND)."""
    masked_softmax_fusion: bool = option(True, "--no-masked-softmax-fusion", action="store_false")
    """Turn off the fused scaled-masked softmax kernel (eager torch ops instead)."""
    attention_softmax_in_fp32: bool = option(True, "--attention-softmax-in-fp32", action="boolean_optional")
    """Softmax of bf16/fp16 attention scores in fp32; --no-attention-softmax-in-fp32 keeps the input dtype."""
    reset_attention_mask: bool = option(False, "--reset-attention-mask")
    """Documents packed into one sample do not see each other: a token attends only to the earlier tokens
    of its own document (the one an end-of-document token closes), as Megatron-LM's flag."""
    reset_position_ids: bool = option(False, "--reset-position-ids")
    """Positions restart at 0 after each end-of-document token (learned and rotary positions alike)."""
    window_size: Optional[Tuple[int, int]] = option(None, "--window-size", parse=parse_window_size,
                                                    unparse=format_window_size, metavar="L[,R]")
    """Sliding-window attention, as Megatron-LM and Transformer Engine write it: a token attends to the L
    tokens before it and itself (R, the tokens after it, is 0 for causal training); 127,0 is gpt-oss's
    128-token window. A single number L means L,0. Default: no window."""
    window_attn_skip_freq: Optional[int] = option(None, "--window-attn-skip-freq", minimum=1, needs=(WINDOW,))
    """With --window-size: every N-th layer (layer numbers N, 2N, ... counted from 1) attends globally, the
    others through the window (gpt-oss: 2)."""
    softmax_type: str = option("vanilla", "--softmax-type", choices=SOFTMAX_TYPES)
    """Attention softmax: vanilla; off-by-one (a zero logit in every row's denominator: exp(s) / (1 + sum exp(s)));
    learnable (gpt-oss's attention sinks: one learned logit per head in the denominator, taking probability mass
    and giving no value; the parameter `softmax_offset` [heads], split over TP with the heads)."""


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2): queries and keys/values through low-rank latents,
    plus one rotary key shared by every head (model/latent_attention.py). Defaults are Megatron-LM's flags'."""
    multi_latent_attention: bool = option(False, "--multi-latent-attention")
    """Multi-head Latent Attention instead of multi-head/grouped-query attention: needs rotary positions (rope or
    yarn); --qk-layernorm gives the latents their RMSNorms (DeepSeek-V3's q_a_layernorm and kv_a_layernorm)."""
    q_lora_rank: Optional[int] = option(None, "--q-lora-rank", minimum=1)
    """MLA: width of the query latent (DeepSeek-V3: 1536); not given: one query projection from the hidden
    state (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = option(32, "--kv-lora-rank", minimum=1)
    """MLA: width of the key/value latent (DeepSeek-V3: 512; Megatron-LM's flag defaults to 32)."""
    qk_head_dim: int = option(128, "--qk-head-dim", minimum=1)
    """MLA: each head's query/key dimensions without position (qk_nope_head_dim in Hugging Face)."""
    qk_pos_emb_head_dim: int = option(64, "--qk-pos-emb-head-dim", minimum=2)
    """MLA: each head's rotary query dimensions, and the width of the one rotary key all heads share
    (qk_rope_head_dim in Hugging Face); a query/key head is --qk-head-dim + this wide."""
    v_head_dim: int = option(128, "--v-head-dim", minimum=1)
    """MLA: each head's value dimensions (the output projection maps heads x this back to --hidden-size)."""
