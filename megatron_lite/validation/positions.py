"""The model's positions: learned or rotary, and the rotary frequencies' scaling (Llama 3.1's, YaRN's) and width.

`--position-embedding-type yarn` is Megatron-LM's other spelling of rotary positions with `--rope-type yarn`: the
completed config holds the latter, so every reader asks one field. A YaRN flag without YaRN would do nothing, so
it is refused, as is every combination whose meaning is not one of the anchors'.
"""
from __future__ import annotations

import dataclasses

from megatron_lite.config import ConfigError, ModelConfig, flag_for

POSITION_TYPES = ("learned_absolute", "rope", "yarn")
YARN_FIELDS = ("rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
               "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim")
"""What only YaRN reads (model/rotary.py)."""


def _defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _given(m: ModelConfig, field: str) -> str:
    """`field` as its flag says it, for a message."""
    flag, value = flag_for(field), getattr(m, field)
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def check_positions(m: ModelConfig) -> ModelConfig:
    """The model config with its positions checked, and `yarn` positions written as rope + --rope-type yarn."""
    position = m.position_embedding_type
    if position not in POSITION_TYPES:
        raise ConfigError(f"--position-embedding-type {position} is not learned_absolute, rope or yarn")
    if m.use_rope_scaling and position == "learned_absolute":
        raise ConfigError("--use-rope-scaling scales rotary frequencies and needs --position-embedding-type rope; "
                          f"got {position}")
    if position == "yarn":
        m = dataclasses.replace(m, position_embedding_type="rope", rope_type="yarn")
    rotary = m.position_embedding_type == "rope"
    if m.rope_type == "yarn" and not rotary:
        raise ConfigError(f"--rope-type yarn scales rotary frequencies and needs --position-embedding-type rope "
                          f"(or yarn); got {position}")
    if m.rope_type == "yarn" and m.use_rope_scaling:
        raise ConfigError("--use-rope-scaling (Llama 3.1's scaling) and YaRN (--rope-type yarn) both scale the rotary "
                          "frequencies; keep one of them")
    defaults = _defaults()
    if m.rope_type != "yarn":
        unread = [_given(m, f) for f in YARN_FIELDS if getattr(m, f) != defaults[f]]
        if unread:
            raise ConfigError(f"{', '.join(unread)}: only YaRN reads {'them' if len(unread) > 1 else 'it'}, and "
                              f"these rotary frequencies are not YaRN's; add --rope-type yarn (or "
                              f"--position-embedding-type yarn), or drop {'them' if len(unread) > 1 else 'it'}")
    if not rotary and m.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {m.rotary_percent:g} says how much of a head RoPE turns, but the "
                          f"positions are {position}; use --position-embedding-type rope, or drop it")
    if rotary:
        _check_rotary_width(m)
    if m.rope_type == "yarn":
        _check_yarn(m)
    return m


def _check_rotary_width(m: ModelConfig) -> None:
    if m.multi_latent_attention:
        return  # the rotary width is --qk-pos-emb-head-dim (validation/latent_attention.py)
    width = (f"--kv-channels {m.kv_channels}" if m.kv_channels is not None else
             f"--hidden-size {m.hidden_size} / --num-attention-heads {m.num_attention_heads} = {m.head_dim}")
    if m.rotary_percent == 1.0 and m.head_dim % 2:
        raise ConfigError(
            f"--position-embedding-type rope needs an even head dimension (RoPE turns pairs of it); {width}. "
            f"Use --kv-channels {m.head_dim + 1}", code="odd_head_dim_with_rope"
        )
    if m.rotary_dim % 2 or m.rotary_dim < 2:
        even = max(2, m.rotary_dim - m.rotary_dim % 2)
        raise ConfigError(
            f"--rotary-percent {m.rotary_percent:g} of the head width ({width}) turns {m.rotary_dim} dimensions, but "
            f"RoPE turns pairs of them; use --rotary-percent {even / m.head_dim:g} ({even} dimensions)",
            code="odd_rotary_dim"
        )


def _check_yarn(m: ModelConfig) -> None:
    if m.rotary_scaling_factor > 1 and m.yarn_original_max_position_embeddings is None:
        raise ConfigError(f"--rotary-scaling-factor {m.rotary_scaling_factor:g} extends the context YaRN's ramp is "
                          f"measured over; give it with --yarn-original-max-position-embeddings (the context the "
                          f"model was trained at, e.g. 4096)")
    if m.yarn_beta_fast < m.yarn_beta_slow:
        raise ConfigError(f"--yarn-beta-fast {m.yarn_beta_fast:g} is below --yarn-beta-slow {m.yarn_beta_slow:g}: "
                          f"the ramp runs from the fast turns down to the slow ones; use --yarn-beta-fast "
                          f"{m.yarn_beta_slow:g} or more (32 and 1 by default; Kimi K2: 1 and 1)")
