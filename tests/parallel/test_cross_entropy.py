"""Vocab-parallel cross entropy against F.cross_entropy on the full logits."""
import functools

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, rank_slice

SEQ, BATCH = 6, 4
VOCAB, PADDED_VOCAB = 13, 16  # targets 13..15 sit in padded rows, as padded vocabularies allow


def _loss_and_logits_grad(tp, logits, target, loss_mask):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.cross_entropy import masked_mean, vocab_parallel_cross_entropy

    state.initialize(tp)
    local = rank_slice(logits, dist.get_rank(), tp, -1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    mean = masked_mean(loss, loss_mask)
    mean.backward()
    # The same logits with the padded columns out of the softmax: targets are real tokens then.
    padded = rank_slice(logits, dist.get_rank(), tp, -1).clone().requires_grad_()
    real_loss = vocab_parallel_cross_entropy(padded, target % VOCAB, VOCAB)
    masked_mean(real_loss, loss_mask).backward()
    return loss.detach(), mean.detach(), local.grad, real_loss.detach(), padded.grad


@functools.lru_cache(maxsize=None)
def _case(tp):
    g = torch.Generator().manual_seed(7)
    logits = 3.0 * torch.randn(SEQ, BATCH, PADDED_VOCAB, generator=g)
    # Every vocabulary row is some position's target, so every rank's range (and the padding) is hit.
    target = torch.cat([torch.arange(PADDED_VOCAB), torch.randint(0, PADDED_VOCAB, (SEQ * BATCH - PADDED_VOCAB,),
                                                                  generator=g)])
    target = target[torch.randperm(target.numel(), generator=g)].view(SEQ, BATCH)
    loss_mask = (torch.rand(SEQ, BATCH, generator=g) > 0.3).float()
    return logits, target, loss_mask, run_distributed(_loss_and_logits_grad, tp, tp, logits, target, loss_mask)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_vocab_parallel_cross_entropy_per_token_loss_matches_dense(tp):
    logits, target, _, results = _case(tp)
    assert target.max() >= VOCAB, "the case must include targets in padded rows"
    dense = F.cross_entropy(logits.view(-1, PADDED_VOCAB), target.view(-1), reduction="none").view(SEQ, BATCH)
    for rank, (loss, *_) in enumerate(results):
        assert loss.dtype == torch.float32
        assert_matches(loss, dense, f"rank {rank} per-token loss")


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_vocab_parallel_cross_entropy_masked_mean_and_logits_grad_match_dense(tp):
    logits, target, loss_mask, results = _case(tp)
    assert 0 < loss_mask.sum() < loss_mask.numel(), "the case must mask some positions and keep others"
    dense_logits = logits.clone().requires_grad_()
    ignored = target.masked_fill(loss_mask == 0, -100)
    dense = F.cross_entropy(dense_logits.view(-1, PADDED_VOCAB), ignored.view(-1), ignore_index=-100)
    dense.backward()
    for rank, (_, mean, grad, *_) in enumerate(results):
        assert_matches(mean, dense.detach(), f"rank {rank} masked mean loss")
        assert_matches(grad, rank_slice(dense_logits.grad, rank, tp, -1), f"rank {rank} logits grad")


def test_vocab_parallel_cross_entropy_of_bf16_logits_is_fp32_and_leaves_logits_untouched():
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, PADDED_VOCAB, generator=g).bfloat16().requires_grad_()
    before = logits.detach().clone()
    target = torch.randint(0, PADDED_VOCAB, (5,), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert torch.equal(logits.detach(), before)
    assert_matches(loss, F.cross_entropy(logits.detach().float(), target, reduction="none"), "bf16 loss")


def test_in_training_fp32_logits_become_the_gradient_buffer_and_without_autograd_they_are_left_untouched():
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, PADDED_VOCAB, generator=g)
    target = torch.randint(0, PADDED_VOCAB, (5,), generator=g)
    dense = F.cross_entropy(logits, target, reduction="none")
    # Evaluation (DeepSpeed's eval_batch runs without autograd and may return the logits).
    evaluated = logits.clone()
    with torch.no_grad():
        assert_matches(vocab_parallel_cross_entropy(evaluated, target), dense, "no-grad loss")
    assert torch.equal(evaluated, logits)
    # Training: the logits produced by a matmul are consumed; loss and gradient are still exact.
    weight = torch.eye(PADDED_VOCAB, requires_grad=True)
    produced = logits @ weight
    loss = vocab_parallel_cross_entropy(produced, target)
    loss.sum().backward()
    assert not torch.equal(produced.detach(), logits), "training must reuse the logits buffer"
    dense_weight = torch.eye(PADDED_VOCAB, requires_grad=True)
    F.cross_entropy(logits @ dense_weight, target, reduction="sum").backward()
    assert_matches(loss, dense, "training loss")
    assert_matches(weight.grad, dense_weight.grad, "gradient through the consumed logits")


def test_masked_mean_of_a_fully_masked_batch_is_zero_not_nan():
    from megatron_lite.parallel.cross_entropy import masked_mean

    loss = torch.rand(3, 2, requires_grad=True)
    mean = masked_mean(loss, torch.zeros(3, 2))
    mean.backward()
    assert mean.item() == 0.0 and torch.equal(loss.grad, torch.zeros(3, 2))


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_padded_vocabulary_columns_are_out_of_the_softmax_and_get_no_gradient(tp):
    logits, target, loss_mask, results = _case(tp)
    real = logits[..., :VOCAB].clone().requires_grad_()
    dense = F.cross_entropy(real.view(-1, VOCAB), (target % VOCAB).view(-1), reduction="none").view(SEQ, BATCH)
    ((dense * loss_mask).sum() / loss_mask.sum()).backward()
    full_grad = torch.cat([real.grad, torch.zeros(SEQ, BATCH, PADDED_VOCAB - VOCAB)], dim=-1)
    for rank, (*_, real_loss, grad) in enumerate(results):
        assert_matches(real_loss, dense.detach(), f"rank {rank} loss over the real vocabulary")
        assert_matches(grad, rank_slice(full_grad, rank, tp, -1), f"rank {rank} logits grad, zero in the padding")
