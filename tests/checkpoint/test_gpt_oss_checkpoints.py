"""Checkpoints of gpt-oss's model carry its new weights between layouts: the sinks (split over TP with the heads),
the router bias (whole on every rank), the experts' biases and the attention biases. A TP 2 run with SP and ZeRO 1
resumes at TP 4 and at PP 2 x DP 2 with the uninterrupted losses, and reshards to TP 4 and back bit for bit, merging
to the dense model's sinks and biases."""
import pytest

from tests.checkpoint.test_llama_checkpoints import _layer_files, _reshard, back_and_merged_bit_for_bit
from tests.checkpoint.test_mla_checkpoints import assert_uninterrupted
from tests.checkpoint.test_resume_anywhere import _train
from tests.harness import run_distributed
from tests.model.test_gpt_oss_parallel import GPT_OSS

pytestmark = pytest.mark.slow

SOURCE = GPT_OSS + ("--sequence-parallel", "--zero-stage", "1")


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """TP 2 with SP and ZeRO 1: 4 steps, saved at step 2; its losses."""
    ckpt = str(tmp_path_factory.mktemp("gpt_oss") / "ckpt")
    losses, _ = run_distributed(_train, 2, 2, 1, 1, SOURCE, ckpt)[0]
    return ckpt, losses


@pytest.mark.parametrize("target, extra", [((4, 1, 1), ("--zero-stage", "1")), ((1, 2, 2), ("--zero-stage", "0"))],
                         ids=["tp4-zero1", "pp2-dp2-zero0"])
def test_a_gpt_oss_run_resumes_at_another_layout_with_the_uninterrupted_losses(tp2_run, target, extra):
    ckpt, full = tp2_run
    resumed, _ = run_distributed(_train, target[0] * target[1] * target[2], *target, GPT_OSS + extra, None, ckpt)[0]
    assert_uninterrupted(resumed, full)


def test_sinks_and_biases_reshard_to_tp4_and_back_bit_for_bit_and_merge_whole(tp2_run, tmp_path):
    ckpt, _ = tp2_run
    two = _layer_files(ckpt)["layer_01-model_01-model_states.pt"]
    _reshard(ckpt, str(tmp_path / "tp4"), 4)
    four = _layer_files(str(tmp_path / "tp4"))["layer_01-model_03-model_states.pt"]
    assert two["attention.softmax_offset"].shape == (2,) and four["attention.softmax_offset"].shape == (1,)
    assert four["attention.softmax_offset"][0] == two["attention.softmax_offset"][1]  # head 3 of 4
    assert four["attention.dense.bias"].shape == (64,)
    dense = back_and_merged_bit_for_bit(ckpt, tmp_path)
    for layer in range(1, 5):
        assert dense[f"layers.{layer}.attention.softmax_offset"].shape == (4,)
        assert dense[f"layers.{layer}.mlp.router.bias"].shape == (8,)
        assert dense[f"layers.{layer}.mlp.experts.bias1"].shape == (8, 96)
        assert dense[f"layers.{layer}.mlp.experts.bias2"].shape == (8, 64)
        assert dense[f"layers.{layer}.mlp.router.bias"].abs().sum() > 0  # trained, not the zeros it began as


def test_a_layer_file_written_before_the_router_had_a_bias_is_refused_saying_why():
    """An MoE checkpoint with biases written before issue 57 lacks mlp.router.bias: the reader names the cause instead
    of 'the file belongs to another model' (measured: resume, --finetune and --no-load-optim all stop on it)."""
    import torch

    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.checkpoint.reader import check_layer_state

    expected = {"mlp.router.weight": (4, 8), "mlp.router.bias": (4,)}
    with pytest.raises(CheckpointError, match="written before the MoE router had a bias"):
        check_layer_state("layer_01.pt", {"mlp.router.weight": torch.zeros(4, 8)}, expected, 1)
