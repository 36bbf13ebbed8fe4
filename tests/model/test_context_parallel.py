"""Context parallelism (--context-parallel-size, all-to-all attention) computes the dense single-process
losses under every layout it composes with: TP, SP, PP, DP with ZeRO 1, RoPE and learned positions,
grouped-query attention, with a loss mask that falls unevenly on the CP ranks."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import dense_losses, global_batches, micro_batches, tiny_config

STEPS = 3
EOD = 5  # a token id the mask leaves out of the loss
ROPE = ("--position-embedding-type", "rope")
LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
         "--use-rope-scaling", "--ffn-hidden-size", "96")


def eod_mask(labels):
    """EOD positions masked, plus the first part of every sequence: at CP 2 rank 0 keeps far fewer
    counted tokens than rank 1, so a per-rank mean would weigh them wrongly."""
    mask = (labels != EOD).float()
    mask[:, : labels.shape[1] // 3] = 0.0
    return mask


def with_eods(batches):
    """Random tokens with EOD sprinkled in (about one in eight)."""
    g = torch.Generator().manual_seed(3)
    return torch.where(torch.rand(batches.shape, generator=g) < 0.125, torch.full_like(batches, EOD), batches)


def _train(tp, cp, pp, dp, extra, steps, masked, eod=None, documents_path=None):
    import torch.distributed as dist

    from megatron_lite.model import attention_mask

    if documents_path is not None:  # attend document by document ("segments") or through the mask
        attention_mask.SEGMENTS_PER_TOKEN = 1.0 if documents_path == "segments" else 0.0

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, extra, cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp)
    engine = Engine(config, with_scheduler=False)
    batches = global_batches(config, steps)
    batches = with_eods(batches) if masked else batches
    data = micro_batches(config, batches, state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp), loss_mask=eod_mask if masked else None, eod=eod)
    losses = [engine.train_step(data).loss for _ in range(steps)]
    return {"rank": dist.get_rank(), "losses": losses, "coord": state.describe()}


def run_layout(tp, cp, pp, dp, extra=(), masked=True, eod=None, documents_path=None):
    return run_distributed(_train, tp * cp * pp * dp, tp, cp, pp, dp, tuple(extra), STEPS, masked, eod, documents_path)


def dense_reference(extra, masked=True, eod=None):
    config = tiny_config(extra=extra)
    batches = global_batches(config, STEPS)
    # A micro-batch's loss is its own masked mean (Megatron-LM's and ours at every layout); with uneven
    # masks that differs from the whole batch's, so the reference runs the same micro-batches.
    return dense_losses(config, with_eods(batches) if masked else batches,
                        micro_batch_size=config.batch.micro_batch_size, loss_mask=eod_mask if masked else None,
                        eod=eod)


def assert_matches(results, reference, tolerance=1e-5):
    for r in results:  # every rank reports the step's loss
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference))
        assert rel <= tolerance, f"rank {r['rank']} {r['coord']}: {r['losses']} vs dense {reference} (rel {rel:.2e})"


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("tp, cp, pp, dp, extra", [
    (1, 2, 1, 1, ()),
    (2, 2, 1, 1, ()),
    (1, 2, 2, 1, ()),
    pytest.param(1, 4, 1, 1, (), marks=pytest.mark.slow),
    pytest.param(2, 2, 1, 2, ("--zero-stage", "1"), marks=pytest.mark.slow),
    pytest.param(2, 2, 1, 1, ("--sequence-parallel",), marks=pytest.mark.slow),
])
def test_context_parallel_layouts_match_the_dense_losses(tp, cp, pp, dp, extra, positions):
    model = ROPE if positions == "rope" else ()
    assert_matches(run_layout(tp, cp, pp, dp, extra + model), dense_reference(model))


@pytest.mark.parametrize("tp, cp, extra", [
    (2, 2, ()),  # 2 groups at TP 2: one per TP rank, repeated for its 2 CP ranks
    (1, 2, ("--recompute-granularity", "selective")),
    pytest.param(1, 2, ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                        "1"), marks=pytest.mark.slow),
    pytest.param(1, 4, ("--attention-backend", "fused"), marks=pytest.mark.slow),  # 2 groups repeated to 4
])
def test_the_llama_block_under_context_parallelism_matches_the_dense_losses(tp, cp, extra):
    kernel = extra if "--attention-backend" in extra else ()  # recompute is a layout choice, the kernel is not
    assert_matches(run_layout(tp, cp, 1, 1, LLAMA + extra), dense_reference(LLAMA + kernel))


def test_yarn_on_part_of_each_head_under_context_parallelism_matches_the_dense_losses():
    """RoPE turns whole sequences after the all-to-all, YaRN's table as plain RoPE's."""
    from tests.model.test_llama_parallel import YARN

    assert_matches(run_layout(2, 2, 1, 1, YARN), dense_reference(YARN))


QK_HEADS = ("--qk-layernorm", "--kv-channels", "24")  # QK-norm before the all-to-all, heads of 24 (not 16)


@pytest.mark.parametrize("tp, cp, extra", [
    (1, 2, ()),
    (2, 2, ("--recompute-granularity", "selective")),
    pytest.param(1, 4, ("--attention-backend", "fused"), marks=pytest.mark.slow),
    pytest.param(1, 2, ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                        "1"), marks=pytest.mark.slow),
])
def test_qk_norm_with_wider_heads_under_context_parallelism_matches_the_dense_losses(tp, cp, extra):
    kernel = extra if "--attention-backend" in extra else ()
    assert_matches(run_layout(tp, cp, 1, 1, LLAMA + QK_HEADS + extra), dense_reference(LLAMA + QK_HEADS + kernel))


def test_zero2_without_a_pipeline_trains_under_context_parallelism():
    assert_matches(run_layout(1, 2, 1, 1, ROPE + ("--zero-stage", "2")), dense_reference(ROPE))


def _streams(tp, cp):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.random import get_rng_tracker, model_parallel_seed

    state.initialize(tp, 1, context_parallel_size=cp)
    model_parallel_seed(7, 1)
    states = get_rng_tracker().get_states()
    return {"rank": dist.get_rank(), "tp": state.get_tensor_model_parallel_rank(),
            "cp": state.get_context_parallel_rank(),
            "streams": {name: s[0] if isinstance(s, tuple) else s for name, s in states.items()}}


def test_dropout_streams_differ_across_context_parallel_ranks_and_agree_across_tp_where_replicated():
    ranks = run_distributed(_streams, 4, 2, 2)
    by_place = {(r["tp"], r["cp"]): r["streams"] for r in ranks}
    same = lambda a, b, name: torch.equal(by_place[a][name], by_place[b][name])  # noqa: E731
    for name in ("embedding", "layer-1"):  # replicated over TP, other tokens on each CP rank
        assert same((0, 0), (1, 0), name) and not same((0, 0), (0, 1), name), name
    for name in ("layer-1-tp-rank", "layer-1-sequence-shard", "model-parallel-rng"):  # a stream per (TP, CP) rank
        assert not same((0, 0), (1, 0), name) and not same((0, 0), (0, 1), name), name


# Packed documents that do not see each other, positions restarting per document, a sliding window on every
# other layer (layers 2 and 4 global), with QK-norm and heads of 24 (not 64 / 4): each layout computes the
# dense single-process losses, with the document ids crossing pipeline stages and the mask built over the
# whole sequence after CP's all-to-all.
DOCUMENTS = ("--reset-attention-mask", "--reset-position-ids", "--window-size", "6", "--window-attn-skip-freq", "2",
             "--qk-layernorm", "--kv-channels", "24", *ROPE)


@pytest.mark.parametrize("path", ["mask", "segments"])
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("tp, cp, pp, dp, extra", [
    (2, 1, 2, 1, ("--sequence-parallel",)),
    (1, 2, 2, 1, ()),
    (2, 2, 1, 1, ("--recompute-granularity", "selective")),  # the checkpointed core takes the mask or documents
    (1, 1, 2, 2, ("--zero-stage", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")),  # a chunk's input is (hidden states, document ids)
    # DualPipeV sends the int32 document ids out to the last rank and back, with CP and recompute
    pytest.param(1, 2, 2, 1, ("--pipeline-schedule", "dualpipev", "--recompute-granularity", "full",
                              "--recompute-method", "uniform", "--recompute-num-layers", "1"), marks=pytest.mark.slow),
])
def test_document_masking_and_a_sliding_window_match_the_dense_losses_under_every_layout(tp, cp, pp, dp, extra,
                                                                                         backend, path):
    """Both paths a document-masked layer takes (model/attention_mask.py): the whole sequence through the
    mask, or document by document; the dense reference's own path is the mask (few tokens per document)."""
    model = DOCUMENTS + ("--attention-backend", backend)
    assert_matches(run_layout(tp, cp, pp, dp, extra + model, eod=EOD, documents_path=path),
                   dense_reference(model, eod=EOD))


def test_the_document_mask_changes_the_losses_so_the_layouts_test_can_fail():
    with_documents = dense_reference(DOCUMENTS, eod=EOD)
    assert all(abs(a - b) > 1e-4 for a, b in zip(with_documents, dense_reference(ROPE, eod=EOD)))
