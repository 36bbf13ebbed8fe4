"""The Llama-family block (GQA, SwiGLU, RMSNorm, no biases, untied head, RoPE with Llama 3.1 scaling)
under every parallel layout computes the dense single-process losses."""
import pytest

from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config
from tests.model.test_gpt_parallel import STEPS, run_layout

LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
         "--use-rope-scaling", "--rotary-base", "500000", "--ffn-hidden-size", "96")


def with_groups(groups):
    flags = list(LLAMA)
    flags[flags.index("--num-query-groups") + 1] = str(groups)
    return tuple(flags)


def dense_reference(extra):
    config = tiny_config(extra=extra)
    return dense_losses(config, global_batches(config, STEPS))


@pytest.fixture(scope="module")
def reference():
    return dense_reference(LLAMA)


def assert_matches(results, reference, tolerance=1e-5):
    for r in results:
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference))
        assert rel <= tolerance, f"rank {r['rank']} {r['coord']}: {r['losses']} vs dense {reference} (rel {rel:.2e})"


@pytest.mark.parametrize("tp, pp, dp, extra", [
    (2, 1, 1, ()),
    (4, 1, 1, ()),  # 2 groups at TP 4: each group's keys and values shared by 2 ranks
    (2, 2, 1, ()),
    (1, 2, 2, ()),
    (2, 1, 2, ("--zero-stage", "1")),
    (2, 1, 1, ("--sequence-parallel",)),
    pytest.param(4, 1, 2, ("--sequence-parallel",), marks=pytest.mark.slow),
])
def test_llama_block_matches_the_dense_losses(tp, pp, dp, extra, reference):
    assert_matches(run_layout(tp, pp, dp, extra=LLAMA + extra), reference)


def test_multi_query_attention_matches_the_dense_losses_at_tp2():
    extra = with_groups(1)
    assert_matches(run_layout(2, 1, 1, extra=extra), dense_reference(extra))


def test_llama_block_with_the_fused_softmax_and_selective_recompute_matches_at_tp4():
    extra = LLAMA + ("--attention-backend", "fused", "--recompute-activations")
    assert_matches(run_layout(4, 1, 1, extra=extra), dense_reference(LLAMA + ("--attention-backend", "fused")))


def test_llama_block_under_full_recompute_matches_at_tp2_pp2(reference):
    extra = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert_matches(run_layout(2, 2, 1, extra=LLAMA + extra), reference)


def test_the_new_block_changes_the_losses(reference):
    # Guards against a flag that parses but is not used: the GPT-2 block's losses differ.
    gpt2 = dense_reference(())
    assert max(abs(a - b) for a, b in zip(gpt2, reference)) > 1e-3
