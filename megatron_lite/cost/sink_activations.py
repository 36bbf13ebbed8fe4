"""What attention sinks (--softmax-type off-by-one / learnable) make one layer keep for backward, per micro-batch,
beyond or instead of the plain attention's rows (cost/activations.py), measured on the CPU by
tests/cost/test_memory.py's census:

  fused softmax  each row's sink probability, fp32 [b, n_c, S]: 4 b n_c S more.
  SDPA           the sink is one more key (model/attention_sinks.py): queries, keys and values are new tensors
                 w = the head's width + 1 rounded up to 8 wide, keys and values S + 1 long; the kernel is handed
                 a mask [b or 1, 1, S, S + 1] always (converted to the queries' dtype), so:
      flash      q' k' v', its output (w wide), the fp32 log-sum-exp and the mask:
                 e b w (2 n_c S + 2 m_c (S + 1)) + 4 b n_c S + e b' S (S + 1)
      math       (CPU with attention dropout) q' and k' (scaled copies), v', and the [b, n_c, S, S + 1] scores,
                 probabilities, dropout mask (fp32) and dropped probabilities, the mask not kept.
Selective recompute keeps the core's inputs as given (the sinks are applied inside it): nothing changes there.
CUDA's memory-efficient kernel (what an explicit mask gets there) is counted as flash; not measured on a GPU.
"""
from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.cost.activation_dims import dims


def padded_head_width(config: Config, device: str) -> int:
    d = dims(config, device)
    return -(-(max(d.head_dim, d.v) + 1) // 8) * 8


def sdpa_sink_bytes(config: Config, device: str, kernel: str) -> int:
    """The SDPA path's inputs, core and mask with sinks (module docstring); kernel "flash" or "math"."""
    d = dims(config, device)
    n, m, w, S = d.attention_heads, d.attention_groups, padded_head_width(config, device), d.S
    if kernel == "flash":
        samples = d.b if config.model.reset_attention_mask else 1
        return d.e * d.b * w * (2 * n * S + 2 * m * (S + 1)) + 4 * d.b * n * S + d.e * samples * S * (S + 1)
    keys = n if n != m else m  # the math path repeats grouped keys and values to every head
    scores = d.b * n * S * (S + 1)
    total = d.e * d.b * w * (n * S + 2 * keys * (S + 1)) + d.e * scores
    if config.model.attention_dropout > 0:
        total += (d.k + d.e) * scores
    return total


def fused_sink_bytes(config: Config, device: str) -> int:
    d = dims(config, device)
    return 4 * d.b * d.attention_heads * d.S
