"""The model's attention: key/value groups against the heads and TP, QK-norm's weights under ZeRO, the windows and
document masks attention can be built from (with a note of the path it takes)."""
from __future__ import annotations

from typing import List

from megatron_lite import batching
from megatron_lite.config import Config, ConfigError


def query_groups(m, tp: int) -> int:
    """Key/value heads: --num-query-groups under --group-query-attention, else one per head."""
    heads = m.num_attention_heads
    if not m.group_query_attention:
        if m.num_query_groups not in (None, heads):
            raise ConfigError(f"--num-query-groups {m.num_query_groups} needs --group-query-attention; add it, "
                              f"or drop --num-query-groups for multi-head attention ({heads} groups)")
        return heads
    groups = m.num_query_groups
    if groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N (key/value heads; 1 is multi-query "
                          f"attention), N dividing --num-attention-heads {heads}, e.g. "
                          f"{batching.or_join([g for g in (1, 2, 4, 8) if heads % g == 0][-2:])}")
    if groups < 1 or heads % groups:
        divisors = [g for g in range(1, heads + 1) if heads % g == 0 and (g % tp == 0 or tp % g == 0)]
        near = sorted(divisors, key=lambda g: abs(g - groups))[:2]
        raise ConfigError(f"--num-query-groups {groups} does not divide --num-attention-heads {heads}; every group "
                          f"serves the same number of query heads. Use --num-query-groups "
                          f"{batching.or_join(sorted(near))}", code="heads_not_divisible_by_groups")
    if groups % tp and tp % groups:
        divisors = [g for g in range(1, heads + 1) if heads % g == 0 and (g % tp == 0 or tp % g == 0)]
        near = sorted(divisors, key=lambda g: abs(g - groups))[:2]
        raise ConfigError(
            f"--num-query-groups {groups} neither divides nor is divided by --tensor-model-parallel-size {tp}: "
            f"each TP rank needs whole groups, or one group shared by TP/groups ranks. Use --num-query-groups "
            f"{batching.or_join(sorted(near))}", code="groups_not_compatible_with_tp")
    head_dim = m.head_dim
    if groups < tp and (groups * head_dim) % tp:
        raise ConfigError(
            f"--num-query-groups {groups} at --tensor-model-parallel-size {tp}: each group's key/value rows "
            f"({head_dim} per group) are kept in {tp // groups} pieces, one per rank sharing it, and "
            f"{head_dim} is not divisible by {tp // groups}. Use --num-query-groups {tp} or a head dimension "
            f"(--kv-channels) divisible by {tp // groups}", code="groups_not_compatible_with_tp")
    return groups


def check_qk_layernorm(config: Config) -> None:
    """QK-norm's weights are shared by every head: at TP > 1 each rank's gradient covers its own heads and is
    summed over TP once per step inside the pipeline engine, which ZeRO 2/3 do not use."""
    p = config.parallel
    # MLA's latent norms are not per head: replicated before the up projections, whole gradients without SP
    if (config.model.qk_layernorm and not config.model.multi_latent_attention and p.tensor_model_parallel_size > 1
            and p.zero_stage >= 2):
        raise ConfigError(f"--qk-layernorm at --tensor-model-parallel-size {p.tensor_model_parallel_size} with "
                          f"--zero-stage {p.zero_stage}: the QK-norm gradients, each TP rank's over its own heads, are "
                          f"summed over TP once per step in the pipeline engine, which ZeRO 2/3 do not use; use "
                          f"--zero-stage 1 (or 0), or --tensor-model-parallel-size 1", code="qk_layernorm_with_zero")


def check_attention_mask(m, notes: List[str]) -> None:
    """--window-size, --window-attn-skip-freq, --reset-attention-mask: values the masks can be built from,
    and a note of the path attention takes with them (model/attention_mask.py)."""
    if m.window_size is not None:
        left, right = m.window_size
        if left < 1:
            raise ConfigError(f"--window-size {left},{right}: L, the earlier tokens a token sees, must be 1 or more; "
                              f"e.g. --window-size 127,0 (a 128-token window)")
        if right != 0:
            raise ConfigError(f"--window-size {left},{right}: R, the later tokens a token sees, must be 0 in causal "
                              f"training; use --window-size {left},0")
        if left >= m.seq_length - 1:
            notes.append(f"note: --window-size {left},0 covers every --seq-length {m.seq_length} sequence: windowed "
                         f"layers attend as global ones (generation past {m.seq_length} tokens still uses the window)")
    if m.window_size is not None and m.window_attn_skip_freq == 1:
        raise ConfigError(f"--window-attn-skip-freq 1 makes every layer global, so --window-size "
                          f"{m.window_size[0]},{m.window_size[1]} is used by none; use --window-attn-skip-freq 2 or "
                          f"more (gpt-oss: 2), or drop both for global attention")
    masked = [name for name, on in (("--reset-attention-mask", m.reset_attention_mask),
                                    ("--window-size", m.window_size is not None)) if on]
    if masked:
        kernel = "the fused softmax's padding mask" if m.attention_backend == "fused" else "SDPA with a boolean mask"
        notes.append(f"note: {' and '.join(masked)}: attention takes an explicit [micro, 1, seq, seq] mask "
                     f"({kernel}; every block is computed, masked ones included)")
