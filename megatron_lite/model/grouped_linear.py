"""y = x W_e^T + b_e for the rows of each expert e in turn: rows [N, in] grouped by expert (counts[e] rows each),
weights [E, out, in], biases [E, out] or None -> [N, out]. One GEMM per expert, written straight into the output
and, in backward, into the input, weight and bias gradients: no per-expert outputs to concatenate and no
per-expert gradients to stack (what F.linear over `weight.unbind(0)` costs: 6% of a CPU MoE step in aten::cat,
measured with torch's profiler on benchmarks/bench_moe.py's model), and nothing kept beyond the rows and the
weights. An expert with no rows gets zero gradients."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.has_bias = counts, bias is not None
        out = x.new_empty((x.shape[0], weight.shape[1]))
        for e, (rows, into) in enumerate(zip(x.split(counts), out.split(counts))):
            if bias is None:
                torch.mm(rows, weight[e].t(), out=into)
            else:
                torch.addmm(bias[e], rows, weight[e].t(), out=into)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = torch.empty_like(weight) if needs_w else None
        grad_b = grad_out.new_empty((weight.shape[0], weight.shape[1])) if ctx.has_bias and needs_b else None
        into = grad_x.split(ctx.counts) if needs_x else [None] * len(ctx.counts)
        for e, (rows, grad, grad_rows) in enumerate(zip(x.split(ctx.counts), grad_out.split(ctx.counts), into)):
            if grad_rows is not None:
                torch.mm(grad, weight[e], out=grad_rows)
            if grad_w is not None:
                torch.mm(grad.t(), rows, out=grad_w[e])  # [out, n] x [n, in]; n = 0 gives zeros
            if grad_b is not None:
                torch.sum(grad, 0, out=grad_b[e])
        return grad_x, grad_w, grad_b, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _GroupedLinear.apply(x, weight, bias, list(counts))
