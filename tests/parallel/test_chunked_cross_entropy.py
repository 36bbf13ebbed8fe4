"""The chunked output loss (--output-loss-chunk-size) against the whole head: parallel_lm_logits then
vocab_parallel_cross_entropy, and against F.cross_entropy on dense logits."""
import functools

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, rank_slice

BATCH, SEQ, HIDDEN = 3, 6, 8
VOCAB, PADDED_VOCAB = 13, 16  # three padded rows: out of the softmax in both heads
CHUNKS = (4, 6, 18, 64)  # 18 tokens: 4 leaves a short last chunk, 64 is one chunk
EXACT = 1e-6


def _heads(tp, sequence_parallel, hidden, weight, target, grad_tokens):
    """(chunk size -> (losses, grad h, grad W) of the chunked head) and the same of the whole head, this rank's."""
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.chunked_cross_entropy import output_layer_input
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_lite.parallel.layers import parallel_lm_logits

    state.initialize(tp)
    rank = dist.get_rank()
    local_hidden = rank_slice(hidden, rank, tp, 1) if sequence_parallel else hidden

    def run(losses_of):
        h = local_hidden.clone().requires_grad_()
        w = rank_slice(weight, rank, tp, 0).clone().requires_grad_()
        losses = losses_of(h, w)
        losses.backward(grad_tokens)
        return losses.detach(), h.grad, w.grad

    whole = run(lambda h, w: vocab_parallel_cross_entropy(
        parallel_lm_logits(h, w, sequence_parallel=sequence_parallel).float(), target, VOCAB))
    chunked = {c: run(lambda h, w: output_layer_input(h, w, c, sequence_parallel).token_losses(target, VOCAB))
               for c in CHUNKS}
    return chunked, whole


@functools.lru_cache(maxsize=None)
def _case(tp, sequence_parallel=False):
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=g)
    target = torch.cat([torch.arange(VOCAB), torch.randint(0, VOCAB, (BATCH * SEQ - VOCAB,), generator=g)])
    target = target[torch.randperm(target.numel(), generator=g)].view(BATCH, SEQ)  # every real row a target
    grad_tokens = torch.rand(BATCH, SEQ, generator=g)  # a loss mask's weights: some near 0, none equal
    results = run_distributed(_heads, tp, tp, sequence_parallel, hidden, weight, target, grad_tokens)
    return hidden, weight, target, grad_tokens, results


def _dense(hidden, weight, target, grad_tokens):
    """Losses and gradients of F.cross_entropy over the real vocabulary of the dense logits."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(h, w)[..., :VOCAB]
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)
    losses.backward(grad_tokens)
    return losses.detach(), h.grad, w.grad


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_chunked_output_loss_matches_the_whole_head_per_token_and_in_both_gradients(tp, sequence_parallel):
    *_, results = _case(tp, sequence_parallel)
    for rank, (chunked, whole) in enumerate(results):
        for chunk, (losses, grad_h, grad_w) in chunked.items():
            where = f"rank {rank}, chunks of {chunk}"
            assert losses.dtype == torch.float32
            assert_matches(losses, whole[0], f"{where}: per-token loss", EXACT)
            assert_matches(grad_h, whole[1], f"{where}: hidden-state gradient", EXACT)
            assert_matches(grad_w, whole[2], f"{where}: weight gradient", EXACT)


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_chunked_output_loss_matches_dense_cross_entropy_and_leaves_the_padded_rows_without_gradient(
        tp, sequence_parallel):
    hidden, weight, target, grad_tokens, results = _case(tp, sequence_parallel)
    losses, grad_h, grad_w = _dense(hidden, weight, target, grad_tokens)
    for rank, (chunked, _) in enumerate(results):
        for chunk, (rank_losses, rank_grad_h, rank_grad_w) in chunked.items():
            where = f"rank {rank}, chunks of {chunk}"
            assert_matches(rank_losses, losses, f"{where}: per-token loss")
            expected_h = rank_slice(grad_h, rank, tp, 1) if sequence_parallel else grad_h
            assert_matches(rank_grad_h, expected_h, f"{where}: hidden-state gradient")
            assert_matches(rank_grad_w, rank_slice(grad_w, rank, tp, 0), f"{where}: weight gradient")
    padded_rows = torch.cat([chunked[CHUNKS[0]][2] for chunked, _ in results])[VOCAB:]
    assert torch.equal(padded_rows, torch.zeros_like(padded_rows))


def test_a_chunk_size_below_one_token_is_refused_with_the_value():
    from megatron_lite.parallel.chunked_cross_entropy import chunked_output_cross_entropy

    with pytest.raises(ValueError, match="chunk size 0"):
        chunked_output_cross_entropy(torch.zeros(2, HIDDEN), torch.zeros(PADDED_VOCAB, HIDDEN),
                                     torch.zeros(2, dtype=torch.long), VOCAB, 0)


GPT_STEPS = 3
PADDED_GPT = ["--vocab-size", "120"]  # padded to 128: the padded rows are out of both losses
CHUNKED = ["--output-loss-chunk-size", "7"]  # 32 tokens a sample: a short last chunk
MTP_FLAGS = ["--position-embedding-type", "rope", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"]


def _gpt_losses(extra, loss_mask=None):
    from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config

    config = tiny_config(extra=PADDED_GPT + list(extra))
    return dense_losses(config, global_batches(config, GPT_STEPS), loss_mask=loss_mask)


def _some_tokens_masked(labels):
    return (labels % 3 != 0).float()


@pytest.mark.parametrize("head", [[], ["--untie-embeddings-and-output-weights"], MTP_FLAGS],
                         ids=["tied", "untied", "multi-token-prediction"])
def test_a_gpt_with_the_chunked_output_loss_trains_as_with_the_whole_head(head):
    whole = _gpt_losses(head, _some_tokens_masked)
    chunked = _gpt_losses(head + CHUNKED, _some_tokens_masked)
    assert_matches(torch.tensor(chunked), torch.tensor(whole), f"training losses with {head or 'a tied head'}")
    assert whole[-1] < whole[0]


def _pipeline_losses(tp, pp, extra):
    from tests.model.test_gpt_parallel import run_layout

    return [r["losses"] for r in run_layout(tp, pp, 1, extra=PADDED_GPT + list(extra))]


def test_the_chunked_output_loss_under_the_pipeline_engine_at_tp2_with_sequence_parallelism_matches_the_dense_gpt():
    from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config

    config = tiny_config(extra=PADDED_GPT)
    dense = dense_losses(config, global_batches(config, GPT_STEPS))
    for losses in _pipeline_losses(2, 2, CHUNKED + ["--sequence-parallel"]):
        assert_matches(torch.tensor(losses), torch.tensor(dense), "pipeline losses (TP 2, PP 2, SP)", 1e-4)


def _head_census(extra):
    """(tokens, padded vocabulary, bytes autograd keeps for one micro-batch of the whole GPT, the (shape, dtype)
    of each tensor the head and its loss save), on one process."""
    from tests.cost.activation_census import _model_and_batch, saved_bytes_per_stage
    from tests.model.gpt_layouts import tiny_config

    config = tiny_config(extra=PADDED_GPT + ["--micro-batch-size", "2"] + list(extra))
    (total,) = saved_bytes_per_stage(config)
    model, _, inputs, labels_and_mask = _model_and_batch(config)
    head = len(model._forward_fns) - 1
    hidden = inputs
    for fn in model._forward_fns[:head]:
        hidden = fn(hidden)
    hidden = hidden.detach().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        model.loss(model._forward_fns[head](hidden), labels_and_mask)
    tokens = config.batch.micro_batch_size * config.model.seq_length
    return tokens, config.model.padded_vocab_size, total, saved


def test_with_the_chunked_output_loss_autograd_keeps_no_tokens_by_vocabulary_fp32_tensor():
    tokens, vocab, whole_bytes, whole_saved = run_distributed(_head_census, 1, [])[0]
    _, _, chunked_bytes, chunked_saved = run_distributed(_head_census, 1, CHUNKED)[0]

    def logits_sized(saved):  # [b, s, V] or [b s, V]
        return [(shape, dtype) for shape, dtype in saved
                if shape[-1:] == (vocab,) and torch.Size(shape).numel() == tokens * vocab]

    assert logits_sized(whole_saved), "the whole head must keep its fp32 softmax (else this test checks nothing)"
    assert not logits_sized(chunked_saved), chunked_saved
    # The softmax (4 bytes a token and column) and the local targets and their mask (9 a token) give way to
    # one fp32 log-sum-exp a token, and the labels the chunked loss keeps themselves (int64, a storage of their own
    # as the sampler hands them over).
    assert whole_bytes - chunked_bytes == tokens * (4 * vocab + 9 - 4 - 8), (whole_bytes, chunked_bytes)
