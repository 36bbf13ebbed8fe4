"""Bytes Multi-Token Prediction's depths keep for backward per micro-batch (model/mtp.py), on the stage that holds
them (the last), in cost/activations.py's notation; the head's share (1 + D times the tokens, the stacked hidden
states it reads) is activations.head_activation_bytes'.

Depth k = 1 .. D, on this rank's s tokens (/ r under sequence parallelism):
  its tokens' embedding  the lookup's indices (int64; at t > 1 the local ids and the out-of-range mask)  8 bs (+ bs)
                         hidden dropout (p > 0): its mask                                             k bsh / r
  enorm, hnorm           each a residual norm without its output (`norm_bytes` - e bsh / r: RMSNorm's fp32 input,
                         which in fp32 is the input itself, the normalised input cast back and rstd; LayerNorm's
                         input, mean and rstd); hnorm's input h_(k-1) is the main final norm's output (k = 1) or
                         the previous depth's, which nothing else keeps
  [enorm; hnorm]         their concatenation, eh_proj's input                                        2 e bsh / r
  decoder layer          one of its kind (numbered L + k: `layer_activation_bytes`, with the config's selective
                         recompute); full recompute runs the stage's transformer layers again, not the depths'
                         (model/recompute.py), so under it a depth keeps all it would keep without
  final norm             a residual norm without its output (the head reads the stacked copy, the next hnorm
                         keeps it)
Without dropout under sequence parallelism at D b = 1 the enorm's input, a sequence shard, is a view of the whole
embedding output [1, s, h]: a norm that keeps its input (LayerNorm, or RMSNorm in fp32) keeps it all, e bsh
(1 - 1/t) more, as on the first stage (activations.embedding_activation_bytes).
"""
from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.cost.activation_dims import dims
from megatron_lite.cost.activations import layer_activation_bytes, norm_bytes


def mtp_activation_bytes(config: Config, device: str = "cuda") -> int:
    """What the D depths keep on their stage for one micro-batch (module docstring); 0 without them."""
    m, d = config.model, dims(config, device)
    depths = m.mtp_num_layers or 0
    if not depths:
        return 0
    shard = d.e * d.bsh // d.r
    norm = norm_bytes(config, device) - shard  # its output is not kept by the next linear (below)
    embedding = 8 * d.bs + (d.bs if d.t > 1 else 0) + (d.k * d.bsh // d.r if m.hidden_dropout > 0 else 0)
    total = depths * (embedding + 3 * norm + 2 * shard)
    total += sum(layer_activation_bytes(config, device, m.num_layers + k) for k in range(1, depths + 1))
    keeps_input = m.normalization == "LayerNorm" or d.e == 4
    if m.hidden_dropout == 0 and d.r > 1 and depths * d.b == 1 and keeps_input:
        total += d.e * d.bsh - shard
    return total
