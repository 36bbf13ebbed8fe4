"""convert_checkpoint.py reshard: weights and Adam moments follow their slicing; training continues exactly."""
import json
import os

import pytest
import torch

from tests.checkpoint.conftest import layout, pretrain, run_tool, scalars

pytestmark = pytest.mark.slow


def _files(ckpt, tag):
    path = os.path.join(ckpt, tag)
    return {name: torch.load(os.path.join(path, name), weights_only=False)
            for name in sorted(os.listdir(path)) if name.endswith("model_states.pt")}


def _reshard(src, dst, tp, pp, *extra):
    return run_tool("tools/convert_checkpoint.py", "reshard", "--load", src, "--save", dst,
                    "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
                    *extra)


def _by_parameter(ckpt):
    from megatron_lite.checkpoint.format import read_latest, read_metadata
    from megatron_lite.checkpoint.layout_free import LayoutFreeReader

    tag = read_latest(ckpt)
    return LayoutFreeReader(os.path.join(ckpt, tag), read_metadata(ckpt, tag)).read()


def test_reshard_tp2_pp2_to_tp1_pp4_and_back_gives_identical_weights_and_optimizer_states(run22, tmp_path):
    _reshard(run22["ckpt"], str(tmp_path / "tp1pp4"), 1, 4)
    four = _files(str(tmp_path / "tp1pp4"), "iter_0000004")
    assert sorted(n for n in four if n.startswith("mp_rank")) == [f"mp_rank_{i:02d}_model_states.pt" for i in range(4)]
    assert four["layer_01-model_00-model_states.pt"]["attention.query_key_value.weight"].shape == (96, 32)
    result = _reshard(str(tmp_path / "tp1pp4"), str(tmp_path / "back"), 2, 2)
    assert "TP=1, PP=4 -> " in result.stdout and "TP=2, PP=2" in result.stdout

    original, back = _files(run22["ckpt"], "iter_0000004"), _files(str(tmp_path / "back"), "iter_0000004")
    assert sorted(original) == sorted(back)
    for name, before in original.items():
        after = back[name]
        if name.startswith("layer_"):
            assert before.keys() == after.keys()
            for key in before:
                assert torch.equal(before[key], after[key]), (name, key)
            continue
        assert before["optimizer"]["param_groups"] == after["optimizer"]["param_groups"], name
        for key in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps"):
            assert before[key] == after[key], (name, key)
    # Every parameter's moments and step, bit for bit. (The last stage's copy of the tied embedding module is
    # not compared: its unused position table never had moments of its own, the layout-free form keeps the
    # owner's, which is what that copy gets after a reshard.)
    by_parameter, back_by_parameter = _by_parameter(run22["ckpt"]), _by_parameter(str(tmp_path / "back"))
    assert by_parameter.keys() == back_by_parameter.keys()
    for key, state in by_parameter.items():
        for field in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(state, field), getattr(back_by_parameter[key], field)), (key, field)
        assert state.step == back_by_parameter[key].step == 4.0


def test_training_after_a_reshard_to_tp1_pp2_continues_the_uninterrupted_tp2_pp2_losses(run22, tmp_path):
    target = str(tmp_path / "tp1pp2")
    _reshard(run22["ckpt"], target, 1, 2, "--iteration", "2")
    result = pretrain(run22["corpus"], 2, layout(1, 2) + ["--train-iters", "4", "--load", target,
                                                          "--tensorboard-dir", str(tmp_path / "tb")])
    assert "resumed from" in result.stdout and "at iteration 2, 8 consumed samples" in result.stdout
    resumed = scalars(tmp_path / "tb", "train/loss")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        expected = run22["losses"][step]
        assert abs(resumed[step] - expected) <= 1e-5 * abs(expected), (step, resumed[step], expected)
    # the LR schedule continued too: the lr logged at step 4 is the uninterrupted run's
    assert scalars(tmp_path / "tb", "train/lr")[4] == pytest.approx(scalars(run22["tb"], "train/lr")[4], abs=1e-12)


def test_no_optimizer_reshard_writes_fresh_moments_and_keeps_the_position(run22, tmp_path):
    target = str(tmp_path / "weights")
    result = _reshard(run22["ckpt"], target, 1, 2, "--no-optimizer")
    assert "no Adam moments" in result.stdout
    metadata = json.load(open(os.path.join(target, "iter_0000004", "megatron_lite.json")))
    # checkpointing.load then asks DeepSpeed for no optimizer state (ZeRO 1 would look for shards)
    assert metadata["optimizer_states"] is False and metadata["iteration"] == 4
    files = _files(target, "iter_0000004")
    for name, state in files.items():
        if name.startswith("mp_rank"):
            assert state["optimizer"]["state"] == {}
            assert len(state["optimizer"]["param_groups"]) == 2 and state["global_steps"] == 4
