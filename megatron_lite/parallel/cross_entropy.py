"""Cross entropy over vocab-split logits that never gathers the full [..., V] logits.

    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v

Each rank holds z[..., start:end]. Columns past the tokenizer's vocabulary (the
rows padded for TP, --make-vocab-size-divisible-by) are left out of the softmax:
their logits count as -inf, so the loss is the real vocabulary's whatever the
padding (an imported model's loss is its own; TP 1 and TP 4 pad differently and
agree), and those rows get no gradient. The max and the sum of exponentials are
all-reduced in fp32 over the TP group; the target logit comes from the one
rank whose range holds the target (the others contribute 0 to the same sum).
Gradient: softmax(z) - onehot(target), each rank for its own columns.

In training (autograd on) the fp32 logits are consumed: shifted, exponentiated
and normalised in place, then turned into the gradient in place, as
Megatron-LM's does. At seq 1024 and vocabulary 4096 each [b, s, V] fp32 buffer
is 64 MB; the out-of-place version allocated three more per micro-batch
(measured: see benchmarks/bench_training.py --part single). The logits feed nothing
else: the head's matmul saves its inputs, not its output. Without autograd
(evaluation, where DeepSpeed may return the logits) they are left untouched.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel.tp import all_reduce, partition_range, tp_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, inplace, vocab_size):
        logits = vocab_parallel_logits.float()  # [..., V/tp]; the caller's own tensor when it is fp32
        padded_from = _first_padded_column(logits.size(-1), vocab_size)
        if padded_from is not None:
            logits = logits if inplace else logits.clone()
            logits[..., padded_from:] = float("-inf")  # exp gives 0: out of the softmax, no gradient
        logits_max = all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)
        logits = logits.sub_(logits_max.unsqueeze(-1)) if inplace else logits - logits_max.unsqueeze(-1)

        start, end = partition_range(logits.size(-1), tp_rank())
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = logits.exp_()  # logits is ours here: the caller's only when inplace
        # One collective for both sums: [2, ...]
        sums = all_reduce(torch.stack([target_logit, exp_logits.sum(dim=-1)]))
        target_logit, sum_exp = sums[0], sums[1]
        loss = sum_exp.log() - target_logit  # [...]

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.logits_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        # softmax - onehot(target) on the owning rank; softmax alone elsewhere. In place: backward runs once.
        grad = softmax.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def _first_padded_column(local_size: int, vocab_size) -> "int | None":
    """This rank's first column past the tokenizer's vocabulary, None when it has none."""
    if vocab_size is None:
        return None
    start, end = partition_range(local_size, tp_rank())
    return None if vocab_size >= end else max(vocab_size - start, 0)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 vocab_size: "int | None" = None) -> torch.Tensor:
    """Per-token fp32 loss [...] from logits [..., V/tp] and integer targets [...] in [0, vocab_size);
    columns from vocab_size on (padding) are out of the softmax (None: every column is in).

    With autograd on, fp32 logits are overwritten (see the module docstring): compute
    the loss last, or pass a copy.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, torch.is_grad_enabled(), vocab_size)


def masked_mean(loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(loss * mask) / sum(mask) over every position.

    The denominator is clamped at 1 so that a micro-batch with every position
    masked gives loss 0 instead of NaN (which would poison gradient accumulation).
    """
    loss_mask = loss_mask.float()
    return (loss.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def weighted_sum(loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(loss * weights): the loss of a context-parallel rank, whose weights already hold the
    micro-batch's token count (data/context_parallel.py)."""
    return (loss.float() * weights.float()).sum()
