"""--optimizer muon gives the dense single-process losses under TP (with query groups shared by TP ranks), PP,
DP, ZeRO 1 and 2, SP and EP: each matrix is orthogonalised whole wherever its shards and partition fragments
lie. Orthogonalising each TP shard on its own (--muon-tp-mode blockwise) or the fused QKV as one matrix does
not, which shows the comparison can fail."""
import pytest

from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config
from tests.model.test_gpt_parallel import run_layout
from tests.model.test_moe_parallel import MOE
from tests.model.test_moe_parallel import run_layout as run_moe_layout

STEPS = 5
MUON = ("--optimizer", "muon", "--lr", "1e-2")
LLAMA_MUON = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
              "--ffn-hidden-size", "96") + MUON
"""Llama's block with 2 key/value groups: at TP 4 two ranks share each group's K and V rows."""


def dense_reference(extra):
    config = tiny_config(extra=extra)
    return dense_losses(config, global_batches(config, STEPS), micro_batch_size=config.batch.micro_batch_size)


@pytest.fixture(scope="module")
def reference():
    return dense_reference(LLAMA_MUON)


def relative_difference(results, reference):
    return max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], reference))


@pytest.mark.parametrize("tp, pp, dp, zero, extra", [
    (2, 1, 1, 0, ()),
    (1, 2, 2, 1, ()),
    (2, 2, 2, 1, ()),
    (4, 1, 2, 1, ("--sequence-parallel",)),
    (1, 1, 2, 2, ()),
])
def test_muon_layouts_give_the_dense_fp32_losses(tp, pp, dp, zero, extra, reference):
    results = run_layout(tp, pp, dp, LLAMA_MUON + ("--zero-stage", str(zero)) + extra, steps=STEPS)
    assert relative_difference(results, reference) <= 1e-5, [r["losses"] for r in results] + [reference]


@pytest.mark.parametrize("wrong", [("--muon-tp-mode", "blockwise"), ("--muon-no-split-qkv",)])
def test_orthogonalising_shards_or_the_fused_qkv_whole_misses_the_dense_losses(wrong, reference):
    results = run_layout(2, 1, 1, LLAMA_MUON + wrong, steps=STEPS)
    assert relative_difference(results, reference) > 1e-4


def test_muon_on_experts_at_ep2_with_tp2_and_zero1_gives_the_dense_losses():
    reference = dense_reference(MOE + MUON)
    results = run_moe_layout(2, 1, 2, 1, 2, MUON + ("--zero-stage", "1"), steps=STEPS)
    assert relative_difference(results, reference) <= 1e-5, [r["losses"] for r in results] + [reference]
