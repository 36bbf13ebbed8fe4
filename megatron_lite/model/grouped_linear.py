"""y = x W_e^T + b_e for the rows of each expert e in turn: rows [N, in] grouped by expert, weights [E, out, in],
biases [E, out] or None -> [N, out]. Nothing is kept for backward but the rows and the weights (what the
activation census measures, tests/cost/test_memory_moe.py), and an expert with no rows gets zero gradients.

`grouped_mm_linear`: where expert e's rows end is a device tensor (offsets [E] int32), so nothing is read to the
host: one torch._grouped_mm in forward, two in backward (the rows' and the weights' gradients). Rows past
offsets[-1] are padding (the copies a capacity dropped at EP 1, parallel/experts.py): zeros out, no gradient.
Where `grouped_mm_takes` the tensors. On the CPU, _grouped_mm is one GEMM per expert: the loop's numbers exactly.

`grouped_linear`: the row counts on the host, one GEMM per expert written straight into the output and, in
backward, into the input, weight and bias gradients: no per-expert outputs to concatenate and no per-expert
gradients to stack (what F.linear over `weight.unbind(0)` costs: 6% of a CPU MoE step in aten::cat, measured with
torch's profiler on benchmarks/bench_moe.py's model). Its sizes are host numbers, so torch.compile leaves it eager.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.flop_counter import register_flop_formula


def grouped_mm_takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these rows and [E, out, in] weights without reading the offsets to the host:
    on the CPU in fp32, bf16 or fp16; on CUDA in bf16 on SM90/SM100 (its CUTLASS kernel; elsewhere torch falls
    back to a loop that copies the offsets to the host at every call). Every row of either operand must be a
    multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or not _cutlass_grouped_mm(x.device.index):
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(w.dtype == x.dtype and w.shape[1] * w.element_size() % 16 == 0
               and w.shape[2] * w.element_size() % 16 == 0 for w in weights)


@torch.compiler.assume_constant_result
def _cutlass_grouped_mm(device_index) -> bool:
    """Whether the GPU has torch's grouped GEMM kernel (SM90, SM100); a constant to a compiled layer."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


@torch.library.custom_op("megatron_lite::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as an op of our own, for its shapes under torch.compile: aten's fake kernel takes bf16
    only (torch 2.13), the CPU kernel also fp32 and fp16. The output is contiguous: `grouped_mm_takes` asks for
    rows of 16-byte multiples, which CUDA's kernel would otherwise pad its output's rows to."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # [N, in] x [E, in, out] -> [N, out]
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))  # [out, N] x [N, in] -> [E, out, in]


@register_flop_formula(torch.ops.megatron_lite.grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    """For torch's FLOP counter (what the FLOP formulas are checked against: tests/cost): each of a's rows meets
    one matrix, 2 x rows x in x out, as for one GEMM of the whole rows (padding rows counted: they are computed)."""
    if len(b_shape) == 3:  # [N, in] x [E, in, out]
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # [out, N] x [N, in], split at the offsets


def _expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] the expert each row belongs to (E for padding past offsets[-1]), from the offsets on device."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


class _GroupedMMLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, offsets, padded):
        ctx.save_for_backward(x, weight)
        # The offsets ([E] int32) ride on ctx, not among the saved tensors: the activation census
        # (tests/cost/test_memory_moe.py) counts what the per-expert loop keeps, rows and weights.
        ctx.offsets, ctx.padded, ctx.has_bias = offsets, padded, bias is not None
        out = _grouped_mm(x, weight.transpose(1, 2), offsets)  # [N, in] x [E, in, out] -> [N, out]
        if bias is not None or padded:
            expert = _expert_of_rows(offsets, x.shape[0])
            if bias is not None:  # a zero row for padding, whose output is cleared below anyway
                out += torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, expert)
            if padded:  # _grouped_mm leaves rows past offsets[-1] as they were allocated
                out.masked_fill_((expert == weight.shape[0]).unsqueeze(1), 0)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        offsets, experts = ctx.offsets, weight.shape[0]
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        grad = grad_out.contiguous()
        expert = _expert_of_rows(offsets, x.shape[0]) if ctx.padded or (ctx.has_bias and needs_b) else None
        if ctx.padded:  # padding rows are no expert's: no gradient reaches the weights or the bias from them
            grad = grad.masked_fill((expert == experts).unsqueeze(1), 0)
        grad_x = grad_w = grad_b = None
        if needs_x:
            grad_x = _grouped_mm(grad, weight, offsets)  # [N, out] x [E, out, in] -> [N, in]
            if ctx.padded:
                grad_x.masked_fill_((expert == experts).unsqueeze(1), 0)
        if needs_w:  # [out, N] x [N, in], the N rows split at the offsets -> [E, out, in]; rows past the end unread
            grad_w = _grouped_mm(grad.t(), x, offsets)
        if ctx.has_bias and needs_b:
            grad_b = grad.new_zeros(experts + 1, grad.shape[1]).index_add_(0, expert, grad)[:experts]
        return grad_x, grad_w, grad_b, None, None


def grouped_mm_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, padded: bool = False) -> torch.Tensor:
    """x [N, in] grouped by expert, expert e's rows ending at offsets[e] ([E] int32 on x's device) -> [N, out].
    padded: rows may follow offsets[-1] (they give zeros); False promises offsets[-1] = N."""
    return _GroupedMMLinear.apply(x, weight, bias, offsets, padded)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.has_bias = counts, bias is not None
        out = x.new_empty((x.shape[0], weight.shape[1]))
        for e, (rows, into) in enumerate(zip(x.split(counts), out.split(counts))):
            if e == weight.shape[0]:  # padding past the last expert's rows
                into.zero_()
            elif bias is None:
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
            if e == weight.shape[0]:
                if grad_rows is not None:
                    grad_rows.zero_()
                continue
            if grad_rows is not None:
                torch.mm(grad, weight[e], out=grad_rows)
            if grad_w is not None:
                torch.mm(grad.t(), rows, out=grad_w[e])  # [out, n] x [n, in]; n = 0 gives zeros
            if grad_b is not None:
                torch.sum(grad, 0, out=grad_b[e])
        return grad_x, grad_w, grad_b, None


@torch.compiler.disable
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N, in] grouped by expert, counts[e] rows each (host numbers; sum N, or one more entry for padding rows
    after the last expert's, which give zeros) -> [N, out]."""
    return _GroupedLinear.apply(x, weight, bias, list(counts))
