"""Auxiliary losses (the MoE router's load-balancing and z-losses) added in backward, where they arise.

`attach(x, loss)` returns x unchanged and makes backward add d(loss)/d(...) x scale to the gradients, as
Megatron-LM's MoEAuxLossAutoScaler does: the loss never joins the language-model loss, so nothing but
hidden states crosses pipeline stages. The scale is set once per step by the training engine to what the
language-model loss's gradient goes through: the loss scale (fp16) x CP (DeepSpeed averages gradients over
DP x CP while a micro-batch's loss is split over its CP ranks) / gradient-accumulation steps.
"""
from __future__ import annotations

import torch

_scale = 1.0


def set_scale(scale: float) -> None:
    global _scale
    _scale = float(scale)


def scale() -> float:
    return _scale


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape = loss.shape
        ctx.device, ctx.dtype = loss.device, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.full(ctx.loss_shape, _scale, dtype=ctx.dtype, device=ctx.device)


def attach(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, with loss's gradient (x the current scale) added to the backward pass through x."""
    return _Attach.apply(x, loss)
