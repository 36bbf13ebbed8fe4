"""Multi-head Latent Attention's flags (model/latent_attention.py): given only with --multi-latent-attention, and
never with what MLA replaces (key/value groups, --kv-channels, learned positions, partial RoPE, a QKV bias)."""
from __future__ import annotations

import dataclasses

from megatron_lite.config import ConfigError, ModelConfig, flag_for

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""What only MLA reads."""


def check_latent_attention(m: ModelConfig) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    if not m.multi_latent_attention:
        unread = [f"{flag_for(f)} {getattr(m, f)}" for f in MLA_FIELDS if getattr(m, f) != defaults[f]]
        if unread:
            raise ConfigError(f"{', '.join(unread)}: only Multi-head Latent Attention reads "
                              f"{'them' if len(unread) > 1 else 'it'}; add --multi-latent-attention, or drop "
                              f"{'them' if len(unread) > 1 else 'it'}")
        return
    replaced = [flag for flag, given in (
        ("--group-query-attention", m.group_query_attention),
        (f"--num-query-groups {m.num_query_groups}", m.num_query_groups not in (None, m.num_attention_heads)),
        (f"--kv-channels {m.kv_channels}", m.kv_channels is not None),
        ("--add-qkv-bias", m.add_qkv_bias),
        (f"--rotary-percent {m.rotary_percent:g}", m.rotary_percent != 1.0)) if given]
    if replaced:
        raise ConfigError(f"--multi-latent-attention with {', '.join(replaced)}: MLA gives every head its own key "
                          f"and value from latents, with head widths --qk-head-dim {m.qk_head_dim} + "
                          f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} (queries, keys; the second the rotary "
                          f"part) and --v-head-dim {m.v_head_dim}, and biases (--add-bias-linear) on its down and "
                          f"output projections; drop {' and '.join(replaced)}", code="mla_with_replaced_flags")
    if m.position_embedding_type not in ("rope", "yarn"):
        raise ConfigError(f"--multi-latent-attention turns its shared key with RoPE; --position-embedding-type "
                          f"{m.position_embedding_type} has none: use --position-embedding-type rope (or yarn)")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}: RoPE turns pairs of dimensions; use "
                          f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim + 1}", code="odd_rotary_dim")
