"""Checkpoints of the Llama-family block move between TP sizes whose query groups split differently: 2 groups
at TP 2 (one whole group per rank), TP 4 (each group's keys and values in pieces on the 2 ranks sharing
it) and TP 1, with the optimizer state, continuing the uninterrupted losses; and checkpoints written
before grouped-query attention existed still resume."""
import json
import os

import pytest
import torch

from tests.checkpoint.conftest import run_tool
from tests.checkpoint.test_resume_anywhere import _relative, _save_after_loading, _train
from tests.harness import run_distributed
from tests.model.test_llama_parallel import LLAMA, QWEN3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """TP 2, 2 query groups, ZeRO 0: 4 steps, saved at step 2; its losses."""
    ckpt = str(tmp_path_factory.mktemp("llama") / "ckpt")
    losses, _ = run_distributed(_train, 2, 2, 1, 1, LLAMA, ckpt)[0]
    return ckpt, losses


@pytest.mark.parametrize("target", [(4, 1, 1), (1, 1, 1), (1, 2, 2)], ids=["tp4-shared-groups", "tp1", "pp2dp2"])
def test_a_tp2_run_with_two_query_groups_resumes_at_another_tp_with_the_uninterrupted_losses(tp2_run, target):
    ckpt, full = tp2_run
    resumed, note = run_distributed(_train, target[0] * target[1] * target[2], *target, LLAMA, None, ckpt)[0]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    assert "Adam moments and step" in note


def test_a_tp2_run_with_qk_norm_and_wider_heads_resumes_at_tp4_with_the_uninterrupted_losses(tmp_path):
    """The QK-norm weights (whole on every rank) and their moments move with the rest; heads of 24 at TP 4."""
    ckpt = str(tmp_path / "ckpt")
    full, _ = run_distributed(_train, 2, 2, 1, 1, QWEN3, ckpt)[0]
    resumed, _ = run_distributed(_train, 4, 4, 1, 1, QWEN3, None, ckpt)[0]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])


def _reshard(src, dst, tp):
    return run_tool("tools/convert_checkpoint.py", "reshard", "--load", src, "--save", dst,
                    "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", "1")


def _merged(ckpt, out):
    run_tool("tools/convert_checkpoint.py", "merge", "--load", ckpt, "--output", out)
    return torch.load(out, weights_only=True)["model"]


def _layer_files(ckpt):
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    folder = os.path.join(ckpt, tag)
    return {n: torch.load(os.path.join(folder, n), weights_only=True) for n in sorted(os.listdir(folder))
            if n.startswith("layer_")}


def back_and_merged_bit_for_bit(ckpt, tmp_path):
    """ckpt (TP 2), resharded to tmp_path/tp4, resharded back to TP 2 bit for bit; both merge to the same dense
    weights, which are returned."""
    _reshard(str(tmp_path / "tp4"), str(tmp_path / "back"), 2)
    original, back = _layer_files(ckpt), _layer_files(str(tmp_path / "back"))
    assert original.keys() == back.keys()
    for name in original:
        for key in original[name]:
            assert torch.equal(original[name][key], back[name][key]), (name, key)
    dense2, dense4 = _merged(ckpt, str(tmp_path / "m2.pt")), _merged(str(tmp_path / "tp4"), str(tmp_path / "m4.pt"))
    assert dense2.keys() == dense4.keys()
    for key in dense2:
        assert torch.equal(dense2[key], dense4[key]), key
    return dense2


def test_reshard_tp2_to_tp4_with_two_groups_and_back_is_bit_identical_and_merges_to_the_dense_weights(tp2_run,
                                                                                                       tmp_path):
    from megatron_lite.config import Config
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed
    from tests.model.gpt_layouts import global_batches, tiny_config

    ckpt, full = tp2_run
    _reshard(ckpt, str(tmp_path / "tp4"), 4)
    four = _layer_files(str(tmp_path / "tp4"))
    hd, h = 16, 64  # 4 heads of 16, 2 groups: rank r holds 1 query head and half of each group's K and V rows
    assert four["layer_01-model_03-model_states.pt"]["attention.query_key_value.weight"].shape == (hd + 2 * hd // 2, h)
    dense2 = back_and_merged_bit_for_bit(ckpt, tmp_path)
    assert dense2["layers.1.attention.query_key_value.weight"].shape == ((4 + 2 * 2) * hd, h)
    assert dense2["layers.1.mlp.dense_h_to_4h.weight"].shape == (2 * 96, h)
    assert not any(k.endswith(".bias") for k in dense2)  # --disable-bias-linear, RMSNorm

    # The merge is the dense model's own state dict: its loss on step 3's batch (the first after the save,
    # whose reported loss is computed from the weights saved at step 2) is the TP 2 run's.
    config = Config.from_dict(json.loads(torch.load(str(tmp_path / "m2.pt"), weights_only=True)["config_json"]))
    model = GPTModel(config)
    model.load_state_dict(dense2, strict=True)
    model_parallel_seed(config.training.seed, config.model.num_layers)  # dropout streams (p = 0 here)
    batch = global_batches(tiny_config(extra=LLAMA), 4)[2]
    tokens, labels = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        loss = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), labels, torch.ones(labels.shape))
    assert _relative(loss.item(), full[3]) <= 1e-5, (loss.item(), full[3])


def test_a_checkpoint_saved_before_grouped_query_attention_still_resumes(tmp_path):
    """The GPT-2 block's fused QKV kept its layout: a checkpoint whose metadata has no fused-weights record
    and whose config has the old field names (layernorm_epsilon, no block fields) resumes exactly."""
    ckpt = str(tmp_path / "ckpt")
    full, _ = run_distributed(_train, 2, 2, 1, 1, (), ckpt)[0]
    path = os.path.join(ckpt, "iter_0000002", "megatron_lite.json")
    metadata = json.load(open(path))
    assert metadata["fused_weights"]["attention.query_key_value"]["rows"] == [64, 64, 64]
    del metadata["fused_weights"]
    model = metadata["config"]["model"]
    model["layernorm_epsilon"] = model.pop("norm_epsilon")
    for name in ("normalization", "swiglu", "group_query_attention", "num_query_groups", "add_bias_linear",
                 "use_rope_scaling", "rope_scaling_factor"):
        del model[name]
    with open(path, "w") as f:
        json.dump(metadata, f)
    resumed, _ = run_distributed(_train, 1, 1, 1, 1, (), None, ckpt)[0]  # TP 2 -> 1: the slices put together
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])


def test_a_checkpoint_whose_fused_layout_this_version_does_not_read_is_refused(tmp_path):
    from megatron_lite.checkpoint.format import CheckpointError, read_metadata

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 1, 1, 1, 1, LLAMA, ckpt, None, 2, 2)
    path = os.path.join(ckpt, "iter_0000002", "megatron_lite.json")
    metadata = json.load(open(path))
    metadata["fused_weights"]["attention.query_key_value"]["parts"] = ["query_key_value_interleaved"]
    with open(path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(CheckpointError, match="fused weights are laid out as"):
        read_metadata(ckpt, "iter_0000002")
