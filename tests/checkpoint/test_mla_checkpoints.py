"""Checkpoints of Multi-head Latent Attention and Multi-Token Prediction carry their new weights (down projections
whole on every TP rank, up projections split by head, the latent norms; the depth's projection, norms and decoder
layer on the last stage) between layouts: a TP 2 run with SP and ZeRO 1 resumes at TP 4 and
at PP 2 x DP 2 with the uninterrupted losses, reshards to TP 4 and back bit for bit, merges to the dense model's
weights, and its universal form resumes under another layout."""
import os

import pytest

from tests.checkpoint.conftest import run_tool
from tests.checkpoint.test_llama_checkpoints import _layer_files, _reshard, back_and_merged_bit_for_bit
from tests.checkpoint.test_resume_anywhere import _relative, _train
from tests.harness import run_distributed
from tests.model.test_mla_parallel import MLA as MLA_ALONE

pytestmark = pytest.mark.slow

MLA = MLA_ALONE + ("--mtp-num-layers", "1")
SOURCE = MLA + ("--sequence-parallel", "--zero-stage", "1")


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """TP 2 with SP and ZeRO 1: 4 steps, saved at step 2; its losses."""
    ckpt = str(tmp_path_factory.mktemp("mla") / "ckpt")
    losses, _ = run_distributed(_train, 2, 2, 1, 1, SOURCE, ckpt)[0]
    return ckpt, losses


def assert_uninterrupted(resumed, full):
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])


@pytest.mark.parametrize("target, extra", [((4, 1, 1), ("--zero-stage", "1")), ((1, 2, 2), ("--zero-stage", "0"))],
                         ids=["tp4-zero1", "pp2-dp2-zero0"])
def test_an_mla_run_resumes_at_another_layout_with_the_uninterrupted_losses(tp2_run, target, extra):
    ckpt, full = tp2_run
    resumed, note = run_distributed(_train, target[0] * target[1] * target[2], *target, MLA + extra, None, ckpt)[0]
    assert_uninterrupted(resumed, full)
    assert "Adam moments and step" in note


def test_mla_weights_reshard_to_tp4_and_back_bit_for_bit_and_merge_to_the_dense_shapes(tp2_run, tmp_path):
    ckpt, _ = tp2_run
    _reshard(ckpt, str(tmp_path / "tp4"), 4)
    four = _layer_files(str(tmp_path / "tp4"))["layer_01-model_03-model_states.pt"]
    # 4 heads of 8 + 4 (queries, keys) and 10 (values): TP rank 3 holds one head of each up projection, and the
    # whole down projections and latent norms.
    assert four["attention.linear_q_up_proj.weight"].shape == (12, 24)
    assert four["attention.linear_kv_up_proj.weight"].shape == (8 + 10, 16)
    assert four["attention.linear_q_down_proj.weight"].shape == (24, 64)
    assert four["attention.linear_kv_down_proj.weight"].shape == (16 + 4, 64)
    assert four["attention.kv_layernorm.weight"].shape == (16,)
    assert four["attention.dense.weight"].shape == (64, 10)
    dense2 = back_and_merged_bit_for_bit(ckpt, tmp_path)
    assert dense2["layers.1.attention.linear_q_up_proj.weight"].shape == (4 * 12, 24)
    assert dense2["layers.1.attention.linear_kv_up_proj.weight"].shape == (4 * 18, 16)
    # the depth after the final norm (5) and the embedding it shares (6, no file): its projection [h, 2h] and
    # decoder layer; then the head
    assert dense2["layers.7.depths.0.eh_proj.weight"].shape == (64, 128)
    assert dense2["layers.7.depths.0.layer.attention.linear_q_up_proj.weight"].shape == (4 * 12, 24)
    assert dense2["layers.8.output.weight"].shape[1] == 64


def test_the_universal_form_of_an_mla_run_resumes_under_another_layout(tp2_run, tmp_path):
    ckpt, full = tp2_run
    universal = str(tmp_path / "universal")
    run_tool("tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save", universal)
    assert os.path.isdir(os.path.join(universal, "iter_0000002"))
    resumed, _ = run_distributed(_train, 2, 1, 2, 1, MLA + ("--zero-stage", "0"), None, universal)[0]
    assert_uninterrupted(resumed, full)
