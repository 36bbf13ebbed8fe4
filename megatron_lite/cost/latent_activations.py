"""Bytes Multi-head Latent Attention keeps for backward per micro-batch (model/latent_attention.py), beyond the
input norm's output that every projection reads; cost/activations.py's notation, and with q_l = --q-lora-rank,
c = --kv-lora-rank, d_qk = d_n + d_r the query/key width (d in Dims), d_v the value width, R = b s / r the rows
of a latent on this rank (the down projections are whole on every TP rank and, under sequence parallelism,
see its shard):

  q latent (with --q-lora-rank) [R, q_l], fresh: with --qk-layernorm its norm (as a residual norm, over q_l,
        its output the up projection's input), else the up projection's input   e R q_l
  kv latent, a view of the kv down output [R, c + d_r] (the shared rotary key's columns beside it): what keeps
        the view keeps the whole output, e R (c + d_r): the up projection without --qk-layernorm, LayerNorm,
        RMSNorm in fp32 (whose fp32 input is the input itself); RMSNorm in 16 bits keeps its fp32 copy
        (4 R c) instead; the norm's other terms as a residual norm's over c
  q, k  RoPE's outputs (MLA always has rotary positions): new [b, n_c, S, d_qk] tensors, Q = K = e b S n_c d_qk
  v     a view of the kv up output [b, S, n (d_n + d_v)] (c = 1; the keys' d_n columns beside it): kept whole,
        e b S n (d_n + d_v), wherever v is kept as given (SDPA's kernels, selective recompute's checkpoint,
        the fused and math paths' matmuls when [b, n_c] folds without a copy: b = 1 or n_c = 1), else a copy
        V = e b S n_c d_v; with context parallelism v is exchanged alone, so what is kept is its own
        all-to-all output, V (as wide as q and k, v goes with them: then a view keeps that output, Q + K + V,
        and folds without a copy only at b = 1 or n_c = 1)
  SDPA  values narrower than queries and keys are padded to their width (model/attention.py): SDPA keeps
        the padded copy, e b S n_c d_qk, and nothing of the view (selective recompute's checkpoint keeps v as
        given, as above); the math path (SDPA's fallback) scales q and k into new fp32 tensors, and from 16-bit
        inputs the values converted to fp32 too: 4 b S n_c (2 d_qk + d_v), d_qk for padded values

The shared rotary key (gathered over the sequence under SP, expanded per head) is concatenated into k: nothing
keeps it. The attention core, the context (d_v wide) and RoPE's tables (d_r wide) are cost/activations.py's.
"""
from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.cost.activation_dims import dims


def _norm_bytes(config: Config, device: str, rows: int, width: int, fresh: bool) -> int:
    """A norm over `width` of `rows` rows with its output: as cost/activations.py's residual norms, but its input
    counted only when `fresh` (a view's storage is counted by the caller)."""
    e = dims(config, device).e
    if config.model.normalization == "RMSNorm":
        kept_input = 4 if e < 4 else (e if fresh else 0)  # 16 bits: an fp32 copy; fp32: the input itself
        return (kept_input + 2 * e) * rows * width + 4 * rows
    statistic = 4 if device == "cuda" else e
    return ((e if fresh else 0) + e) * rows * width + 2 * statistic * rows


def latent_bytes(config: Config, device: str = "cuda") -> int:
    """What the latents keep (module docstring): the query latent's norm or the up projection's input, and the
    key/value latent's, with the kv down output kept whole where a view of it is kept."""
    m, d = config.model, dims(config, device)
    rows, q, c = d.bs // d.r, m.q_lora_rank, m.kv_lora_rank
    total = 0
    if q:
        total += _norm_bytes(config, device, rows, q, fresh=True) if m.qk_layernorm else d.e * rows * q
    kv_down = d.e * rows * (c + m.qk_pos_emb_head_dim)
    if not m.qk_layernorm:
        return total + kv_down
    copies = m.normalization == "RMSNorm" and d.e < 4  # its fp32 copy, not a view of the kv down output
    return total + _norm_bytes(config, device, rows, c, fresh=False) + (0 if copies else kv_down)


def latent_attention_input_bytes(config: Config, device: str, kernel: str, checkpointed: bool = False) -> int:
    """The q, k, v storages the attention keeps under `kernel` (cost/activations.attention_kernel; "flash" also
    for selective recompute's checkpoint, which keeps its inputs as given): module docstring."""
    d = dims(config, device)
    n = d.attention_heads
    qk, v = d.e * d.b * d.S * n * d.head_dim, d.e * d.b * d.S * n * d.v
    padded = kernel != "fused" and not checkpointed and d.v != d.head_dim  # SDPA's values, padded: new
    if kernel == "math" and d.e < 4:
        return 4 * d.b * d.S * n * (3 * d.head_dim if padded else 2 * d.head_dim + d.v)
    if padded:  # flash: q, k and the padded values as given; math in fp32: q and k scaled anew, the values
        return 3 * qk
    packed = d.c > 1 and d.v == d.head_dim  # one all-to-all of q, k and v together
    if d.c == 1:
        v_whole = d.e * d.b * d.S * n * (config.model.qk_head_dim + d.v)
    else:
        v_whole = 2 * qk + v if packed else v
    folds = d.b == 1 or n == 1 or (d.c > 1 and not packed)  # [b, n_c, S, d_v] -> [b n_c, S, d_v] as a view
    return 2 * qk + (v_whole if kernel == "flash" or folds else v)
