"""Which layers route their tokens to experts, and the widths an MoE layer uses: torch-free, so validation,
the estimate and the planner ask the same rule the model builds by (the layer itself: model/moe.py)."""
from __future__ import annotations

from typing import Tuple

from megatron_lite.config import ModelConfig, parse_moe_layer_freq
from megatron_lite.config.flag_values import moe_layer_list


def moe_layer_pattern(model: ModelConfig) -> Tuple[bool, ...]:
    """One entry per layer (layer 1 first): True where the layer is MoE. Without --num-experts, none is."""
    if model.num_experts is None:
        return (False,) * model.num_layers
    return tuple(bool(v) for v in moe_layer_list(model.moe_layer_freq, model.num_layers))


def is_moe_layer(model: ModelConfig, layer_number: int) -> bool:
    """Layer `layer_number` (counted from 1) has routed experts instead of the dense MLP; a Multi-Token Prediction
    depth's layer (numbered after --num-layers) is of the last layer's kind, as DeepSeek-V3's."""
    return moe_layer_pattern(model)[min(layer_number, model.num_layers) - 1]


def expert_ffn_hidden_size(model: ModelConfig) -> int:
    """A routed expert's inner width: --moe-ffn-hidden-size, else --ffn-hidden-size."""
    return model.moe_ffn_hidden_size or model.ffn_hidden_size


def layer_freq_for(model: ModelConfig, layers: int) -> str:
    """--moe-layer-freq for the same model cut to its first `layers` layers (the planner's probes and
    calibration runs): a pattern keeps its first entries, with its last one MoE if the cut left none; N stays."""
    _, pattern = parse_moe_layer_freq(model.moe_layer_freq)
    if pattern is None:
        return model.moe_layer_freq
    cut = list(pattern[:layers])
    if any(pattern) and not any(cut):
        cut[-1] = 1
    return "[" + ",".join(map(str, cut)) + "]"
