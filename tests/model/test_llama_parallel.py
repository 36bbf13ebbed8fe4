"""The Llama-family block (GQA, SwiGLU, RMSNorm, no biases, untied head, RoPE with Llama 3.1 scaling)
under every parallel layout computes the dense single-process losses; so does it with Qwen2's attention
(biases on the QKV linear alone) and with Qwen3's (QK-norm, heads wider than hidden / heads), whose norm
weights, shared by the heads a TP rank splits, train to the dense model's."""
import pytest
import torch

from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config
from tests.model.test_gpt_parallel import STEPS, run_layout

LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
         "--use-rope-scaling", "--rotary-base", "500000", "--ffn-hidden-size", "96")


QKV_BIAS = ("--add-qkv-bias", "--lr", "1e-2")
"""Qwen2's attention: biases on the QKV linear alone (LLAMA has --disable-bias-linear). They start at zero, so
at the learning rate of 1e-3 they move the third loss by only 2x the tolerance; at 1e-2 by 40x."""

QK_HEADS = ("--qk-layernorm", "--kv-channels", "24")
"""Every query and key head normalised before RoPE (--normalization's kind), heads of 24, not 64 / 4 = 16."""
QWEN3 = LLAMA + QK_HEADS

YARN = tuple(f for f in LLAMA if f != "--use-rope-scaling") + (
    "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
    "1000", "--yarn-beta-fast", "8", "--rotary-percent", "0.5", "--rotary-base", "100", "--init-method-std", "0.1")
"""YaRN over the first half of each head (GLM-4.5's partial RoPE), s 4, cos and sin times 0.1 ln 4 + 1; base 100,
an original context of 1000 and beta_fast 8 start the ramp inside the 4 frequencies of the 8 turned dimensions (it
runs over 2 to 5: the first three kept, the fourth a third of the way to interpolated). Weights of std 0.1: attention
far from uniform, so the positions move the losses well past the tolerance."""


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


@pytest.mark.parametrize("tp, pp, dp, extra", [
    (2, 1, 1, ("--sequence-parallel",)),
    (2, 2, 1, ()),
    pytest.param(1, 2, 2, ("--zero-stage", "1"), marks=pytest.mark.slow),
    (2, 1, 1, ("--attention-backend", "fused")),
])
def test_yarn_on_part_of_each_head_matches_the_dense_losses(tp, pp, dp, extra):
    kernel = extra if "--attention-backend" in extra else ()  # the kernel is the model's, the layout is not
    assert_matches(run_layout(tp, pp, dp, extra=YARN + extra), dense_reference(YARN + kernel))


def test_yarn_and_the_rotary_percent_change_the_losses(reference):
    """The layouts above could not tell YaRN or a partial turn from plain RoPE otherwise."""
    yarn = dense_reference(YARN)
    whole_heads = dense_reference(tuple(f for f in YARN if f not in ("--rotary-percent", "0.5")))
    plain = dense_reference(tuple(f for f in LLAMA if f != "--use-rope-scaling") + ("--rotary-base", "100",
                                                                                     "--init-method-std", "0.1"))
    for other in (whole_heads, plain):
        assert max(abs(a - b) / b for a, b in zip(other, yarn)) > 1e-3


@pytest.mark.parametrize("tp, pp, dp, extra", [
    (2, 1, 1, ()),
    pytest.param(2, 1, 1, ("--sequence-parallel",), marks=pytest.mark.slow),
])
def test_qkv_bias_alone_matches_the_dense_losses(tp, pp, dp, extra):
    reference = dense_reference(LLAMA + QKV_BIAS)
    without_bias = dense_reference(LLAMA + QKV_BIAS[1:])
    assert max(abs(a - b) / b for a, b in zip(without_bias, reference)) > 1e-4, "the bias should change the losses"
    assert_matches(run_layout(tp, pp, dp, extra=LLAMA + QKV_BIAS + extra), reference)


def dense_reference_with_weights(extra):
    config = tiny_config(extra=extra)
    weights = {}
    return dense_losses(config, global_batches(config, STEPS), weights=weights), weights


@pytest.fixture(scope="module")
def qwen3_reference():
    return dense_reference_with_weights(QWEN3)


def assert_qk_norms_match(results, weights):
    """Each rank's QK-norm weights (every TP rank holds them whole) are the dense model's after the steps: their
    gradients, each TP rank's from its own heads, were summed over TP."""
    for r in results:
        assert r["qk_norms"], f"rank {r['rank']} holds no QK-norm"
        for name, tensor in r["qk_norms"].items():
            # The message keeps torch's own (how many elements, how far apart): on the H200 this failed for
            # layers.1.attention.k_layernorm.bias with only the name printed (docs/gpu-check.md).
            torch.testing.assert_close(tensor, weights[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda detail, r=r, name=name: f"rank {r['rank']} {name}: {detail}")


@pytest.mark.parametrize("tp, pp, dp, extra", [
    (2, 1, 1, ()),
    (2, 1, 1, ("--sequence-parallel",)),
    (2, 2, 1, ()),
    (2, 1, 2, ("--zero-stage", "1")),
    pytest.param(4, 1, 1, (), marks=pytest.mark.slow),  # 2 groups shared by 2 ranks each
    pytest.param(2, 2, 1, ("--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"), marks=pytest.mark.slow),
    pytest.param(2, 1, 1, ("--attention-backend", "fused", "--recompute-activations"), marks=pytest.mark.slow),
])
def test_qk_norm_with_wider_heads_matches_the_dense_losses_and_norm_weights(tp, pp, dp, extra, qwen3_reference):
    losses, weights = qwen3_reference
    results = run_layout(tp, pp, dp, extra=QWEN3 + extra)
    assert_matches(results, losses)
    assert_qk_norms_match(results, weights)


def test_layernorm_qk_norm_of_the_gpt2_block_with_wider_heads_matches_at_tp2_pp2():
    """LayerNorm's weight and bias per head, both shared by the heads. With RoPE: without it the key norm's
    bias adds the same q.b to all of a query's scores, which softmax ignores (its gradient is rounding
    noise, which Adam turns into steps of the learning rate)."""
    extra = QK_HEADS + ("--position-embedding-type", "rope")
    losses, weights = dense_reference_with_weights(extra)
    results = run_layout(2, 2, 1, extra=extra)
    assert_matches(results, losses)
    assert_qk_norms_match(results, weights)
    assert {name.rsplit(".", 1)[1] for r in results for name in r["qk_norms"]} == {"weight", "bias"}


def test_qk_norm_and_the_head_width_change_the_losses(reference, qwen3_reference):
    # Guards against flags that parse but are not used.
    for extra in (LLAMA + ("--qk-layernorm",), LLAMA + ("--kv-channels", "24")):
        assert max(abs(a - b) for a, b in zip(dense_reference(extra), reference)) > 1e-3, extra
