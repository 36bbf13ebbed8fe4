"""The output layer and the vocab-parallel cross entropy in token chunks (--output-loss-chunk-size): the
[tokens, V/tp] fp32 logits are never held whole.

    per chunk c of n tokens:  z_c = h_c W^T   [n, V/tp],   loss_c = lse(z_c) - z_c[target]

The loss of each token is parallel/cross_entropy.py's: the padded vocabulary columns (from vocab_size on) are
out of the softmax, the max and the sums of exponentials are all-reduced in fp32 over the TP group, and the
target logit comes from the rank whose columns hold it. What autograd keeps is h, W, the targets and one fp32
log-sum-exp per token; backward computes each chunk's logits again (one more output GEMM, as Liger's and
Megatron-LM's fused linear cross entropies do) and turns them into

    g_c = g_tok (softmax(z_c) - onehot(target)),   grad_h_c = g_c W,   grad_W += g_c^T h_c

so no collective runs in backward: the hidden state's gradient is partial over TP and the mapping in front of
this function (the TP copy, or the sequence-parallel gather) sums it, as it does for the whole head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel.cross_entropy import _first_padded_column
from megatron_lite.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from megatron_lite.parallel.tp import all_reduce, partition_range, tp_rank, tp_world_size


class _ChunkedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, chunk_size):
        rows = hidden.reshape(-1, hidden.size(-1))  # [b, s, h] -> [n, h]
        targets = target.reshape(-1)
        padded_from = _first_padded_column(weight.size(0), vocab_size)
        start, end = partition_range(weight.size(0), tp_rank())
        loss = torch.empty(rows.size(0), dtype=torch.float32, device=rows.device)
        lse = torch.empty_like(loss)
        for first in range(0, rows.size(0), chunk_size):
            part = slice(first, first + chunk_size)
            logits = _chunk_logits(rows[part], weight, padded_from)  # [c, V/tp] fp32
            logits_max = all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)
            logits.sub_(logits_max.unsqueeze(-1))
            outside = (targets[part] < start) | (targets[part] >= end)
            local_target = (targets[part] - start).masked_fill(outside, 0)
            target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
            sums = all_reduce(torch.stack([target_logit, logits.exp_().sum(dim=-1)]))  # one collective: [2, c]
            log_sum_exp = sums[1].log()
            loss[part] = log_sum_exp - sums[0]
            lse[part] = log_sum_exp + logits_max
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.vocab_size, ctx.chunk_size = vocab_size, chunk_size
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, lse = ctx.saved_tensors
        rows = hidden.reshape(-1, hidden.size(-1))
        targets, grads = target.reshape(-1), grad_loss.reshape(-1).float()
        padded_from = _first_padded_column(weight.size(0), ctx.vocab_size)
        start, end = partition_range(weight.size(0), tp_rank())
        grad_rows = torch.empty_like(rows)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # summed over chunks
        for first in range(0, rows.size(0), ctx.chunk_size):
            part = slice(first, first + ctx.chunk_size)
            grad_logits = _chunk_logits(rows[part], weight, padded_from).sub_(lse[part].unsqueeze(-1)).exp_()
            outside = (targets[part] < start) | (targets[part] >= end)
            local_target = (targets[part] - start).masked_fill(outside, 0)
            # softmax - onehot(target) on the owning rank, softmax alone elsewhere; times the tokens' gradient.
            grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
            grad_logits = grad_logits.mul_(grads[part].unsqueeze(-1)).to(weight.dtype)  # [c, V/tp]
            grad_rows[part] = grad_logits.matmul(weight)  # [c, V/tp] x [V/tp, h] -> [c, h], partial over TP
            grad_weight.addmm_(grad_logits.t().float(), rows[part].float())
        return grad_rows.view(hidden.shape), grad_weight.to(weight.dtype), None, None, None


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, padded_from: Optional[int]) -> torch.Tensor:
    """fp32 logits [c, V/tp] of rows [c, h], the matmul in the weight's dtype as the whole head's; the padded
    columns -inf (exp gives 0: out of the softmax, no gradient)."""
    logits = F.linear(rows, weight).float()
    if padded_from is not None:
        logits[:, padded_from:] = float("-inf")
    return logits


def chunked_output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 vocab_size: Optional[int], chunk_size: int) -> torch.Tensor:
    """Per-token fp32 loss [...] of hidden [..., h] (every token's, after the head's TP mapping) against the
    vocab-split weight [V/tp, h] and targets [...]: vocab_parallel_cross_entropy(hidden @ W^T, target,
    vocab_size), chunk_size tokens at a time."""
    if chunk_size < 1:
        raise ValueError(f"output loss chunk size {chunk_size} must be at least 1 token")
    return _ChunkedOutputCrossEntropy.apply(hidden, weight, target, vocab_size, chunk_size)


@dataclass
class OutputLayerInput:
    """What the head hands the loss instead of logits under --output-loss-chunk-size: its input after the TP
    mapping, and the output weight (the embedding's when tied: the same parameter)."""
    hidden: torch.Tensor
    """[b, s, h]: every position of the sequence (gathered under sequence parallelism)."""
    weight: torch.Tensor
    """[V/tp, h]."""
    chunk_size: int
    """Tokens per chunk."""

    @property
    def shape(self) -> torch.Size:
        """The logits' shape [b, s, V/tp], for callers that size the labels by it (cost/spec_profile.py)."""
        return self.hidden.shape[:-1] + self.weight.shape[:1]

    def logits(self) -> torch.Tensor:
        """The whole [b, s, V/tp] logits (for a caller that asks the model for them)."""
        return F.linear(self.hidden, self.weight)

    def token_losses(self, labels: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
        return chunked_output_cross_entropy(self.hidden, self.weight, labels, vocab_size, self.chunk_size)


def output_layer_input(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int,
                       sequence_parallel: bool = False) -> OutputLayerInput:
    """The head's input [b, s, h] (sequence parallel: [b, s/tp, h]) through the mapping parallel_lm_logits puts
    in front of its matmul: backward sums the partial input gradient over TP (and keeps this rank's shard).
    Under sequence parallelism the gathered [b, s, h] is kept for backward, not the shard (1/tp of it)."""
    if sequence_parallel and tp_world_size() > 1:
        hidden = gather_from_sequence_parallel_region(hidden)  # [b, s/tp, h] -> [b, s, h]
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    return OutputLayerInput(hidden, weight, chunk_size)
