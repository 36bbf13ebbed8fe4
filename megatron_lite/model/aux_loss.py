"""Auxiliary losses (the MoE router's load-balancing and z-losses) added in backward, where they arise.

`attach(x, loss)` returns x unchanged and makes backward add d(loss)/d(...) x scale to the gradients, as
Megatron-LM's MoEAuxLossAutoScaler does: the loss never joins the language-model loss, so nothing but
hidden states crosses pipeline stages. The scale is set once per step by the training engine to what the
language-model loss's gradient goes through: the loss scale (fp16) x CP (DeepSpeed averages gradients over
DP x CP while a micro-batch's loss is split over its CP ranks) / gradient-accumulation steps.

The scale is a CPU tensor changed in place, not a Python float: a compiled layer (model/compile.py) takes it as
an input, where a float would be a constant dynamo recompiles for at every new value (fp16's loss scale moves).
Multiplying a device tensor by a CPU scalar tensor reads nothing from the device.
"""
from __future__ import annotations

import torch

_scale = torch.ones((), dtype=torch.float64)


def set_scale(scale: float) -> None:
    _scale.fill_(float(scale))


def scale() -> float:
    return float(_scale)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape, ctx.dtype = loss.shape, loss.dtype
        ctx.scale = _scale  # on ctx, not saved: nothing for the activation census to count
        # Compiled, a copy: aot autograd rebuilds a view that leaves a graph (the routing weights do at EP > 1,
        # whose dispatch runs eagerly) from its base, without this backward, and the loss's gradient was lost.
        # Eager keeps the view: nothing more is stored.
        return x.clone() if torch.compiler.is_compiling() else x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        # ones x scale is the scale rounded to the loss's dtype, as torch.full(shape, scale) gave
        return grad_output, grad_output.new_ones(ctx.loss_shape, dtype=ctx.dtype) * ctx.scale


def attach(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, with loss's gradient (x the current scale) added to the backward pass through x."""
    return _Attach.apply(x, loss)
