"""The MLP's activation (model/mlp.py, and every expert's in model/moe.py), as Megatron-LM's flags choose it:

    GeLU           gelu(x), exact (erf), or the tanh approximation with --openai-gelu
    --swiglu       x = [gate | up]: silu(gate) * (up + o)
    --quick-geglu  x = [gate | up]: quick_gelu(gate) * (up + o),  quick_gelu(g) = g sigmoid(1.702 g)

with o = --glu-linear-offset; --activation-func-clamp-value c first clamps the gate to at most c and up to
[-c, c]. gpt-oss is --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7 (transformers'
GptOssExperts). The gated units' input is fc1's [.., 2f/tp] output: each TP rank holds the matching f/tp
columns of both halves (stride 2), so the activation needs no communication.

Plain SwiGLU is left to autograd, which keeps [gate; up], silu(gate) and the product (4f per token); every
other gated unit is one autograd Function that keeps its input alone and recomputes the rest in backward
(2f, plus the product the next linear keeps), where autograd would also keep the clamped halves, the sigmoid,
the activation and the offset half: up to 7f for gpt-oss's.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig

QUICK_GELU_ALPHA = 1.702
"""quick_gelu(g) = g sigmoid(1.702 g), GeLU's sigmoid approximation (gpt-oss's swiglu_alpha)."""


def mlp_activation(config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """fc1's output -> the activated tensor fc2 takes ([.., 2f] -> [.., f] for a gated unit)."""
    if not config.gated_linear_unit:
        return functools.partial(F.gelu, approximate="tanh" if config.openai_gelu else "none")
    clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset
    if config.swiglu and clamp is None and offset == 0.0:
        return swiglu
    alpha = 1.0 if config.swiglu else QUICK_GELU_ALPHA  # silu(g) = g sigmoid(g)
    return functools.partial(gated_linear_unit, alpha=alpha, clamp=clamp, offset=offset)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_linear_unit(x: torch.Tensor, alpha: float, clamp: Optional[float] = None,
                      offset: float = 0.0) -> torch.Tensor:
    """[.., 2f] = [gate | up] -> gate' sigmoid(alpha gate') * (up' + offset), gate' and up' clamped with `clamp`."""
    return _GatedLinearUnit.apply(x, alpha, clamp, offset)


def _clamped_halves(x: torch.Tensor, clamp: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    gate, up = x.chunk(2, dim=-1)
    if clamp is None:
        return gate, up
    return gate.clamp(max=clamp), up.clamp(-clamp, clamp)


class _GatedLinearUnit(torch.autograd.Function):
    """Keeps x alone; backward recomputes the halves and the sigmoid from it (elementwise, cheap)."""

    @staticmethod
    def forward(ctx, x, alpha, clamp, offset):
        ctx.save_for_backward(x)
        ctx.alpha, ctx.clamp, ctx.offset = alpha, clamp, offset
        gate, up = _clamped_halves(x, clamp)
        # gate * sigmoid(gate * alpha), in transformers' order of operations (GptOssExperts._apply_gate)
        return gate * torch.sigmoid(gate * alpha) * (up + offset)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        alpha, clamp, offset = ctx.alpha, ctx.clamp, ctx.offset
        gate, up = _clamped_halves(x, clamp)
        s = torch.sigmoid(gate * alpha)
        # d/dg g sigmoid(alpha g) = s + alpha g s (1 - s)
        grad_gate = grad * (up + offset) * (s + alpha * gate * s * (1 - s))
        grad_up = grad * gate * s
        if clamp is not None:  # as torch's clamp: no gradient where the input was outside [min, max]
            gate_in, up_in = x.chunk(2, dim=-1)
            grad_gate = grad_gate.masked_fill(gate_in > clamp, 0.0)
            grad_up = grad_up.masked_fill(up_in.abs() > clamp, 0.0)
        return torch.cat([grad_gate, grad_up], dim=-1), None, None, None
