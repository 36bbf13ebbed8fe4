"""The dense MLP of a transformer layer on tensor-parallel linears (GeLU, or gated: SwiGLU, quick-GeGLU), and the
weight initialisations the layers share; also an MoE layer's shared expert (model/moe.py)."""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.activation import mlp_activation
from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, set_matrix_attributes


def normal_init(std: float):
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def scaled_normal_init(std: float, num_layers: int):
    """Output projections of residual branches: std / sqrt(2 L), as in GPT-2 and Megatron-LM."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


class ParallelMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), act GeLU (exact, or tanh with --openai-gelu) or a gated unit:
    --swiglu's silu(gate) * up or --quick-geglu's, with --glu-linear-offset and --activation-func-clamp-value
    (model/activation.py).

    Gated, the master [2 ffn, h] weight of dense_h_to_4h is [gate; up] and each rank takes the matching
    ffn/tp rows of both (stride 2), so its gate and up slices belong together."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool = False):
        super().__init__()
        ffn, gated = config.ffn_hidden_size, config.gated_linear_unit
        self.activation = mlp_activation(config)
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, 2 * ffn if gated else ffn,
                                                  bias=config.add_bias_linear, stride=2 if gated else 1,
                                                  init_method=normal_init(config.init_method_std),
                                                  sequence_parallel=sequence_parallel)
        if gated:
            set_matrix_attributes(self.dense_h_to_4h.weight, fused="gate_up")
        self.dense_4h_to_h = RowParallelLinear(
            ffn, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=scaled_normal_init(config.init_method_std, config.num_layers),
            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, h] -> [b, s, ffn/tp] (gated: [b, s, 2 ffn/tp] first) -> [b, s, h]
        # (sequence parallel: [b, s/tp, h] in and out)
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x)))
