"""The layout-free form on disk (convert_checkpoint.py universal), vocabulary padding that changes with TP, and
checkpoints that cannot be moved."""
import os

import pytest
import torch

from tests.checkpoint.conftest import error_line, run_tool
from tests.checkpoint.test_resume_anywhere import _relative, _train
from tests.harness import run_distributed

pytestmark = pytest.mark.slow


def _layout_free(path):
    from megatron_lite.checkpoint.format import read_latest, read_metadata
    from megatron_lite.checkpoint.layout_free import LayoutFreeReader

    tag = read_latest(path)
    return LayoutFreeReader(os.path.join(path, tag), read_metadata(path, tag))


def test_the_universal_form_holds_every_parameter_and_resumes_under_another_layout_and_zero_stage(tmp_path):
    ckpt, universal = str(tmp_path / "ckpt"), str(tmp_path / "universal")
    full, _ = run_distributed(_train, 2, 1, 1, 2, ["--zero-stage", "1"], ckpt)[0]
    result = run_tool("tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save", universal)
    assert "(TP=1, PP=1, DP=2, ZeRO 1, fp32)" in result.stdout and "--load it under any layout" in result.stdout
    source, written = _layout_free(ckpt).read(), _layout_free(universal)
    assert written.universal and written.read().keys() == source.keys()
    for key, state in written.read().items():
        assert torch.equal(state.fp32, source[key].fp32) and torch.equal(state.exp_avg, source[key].exp_avg)
    assert sorted(os.listdir(os.path.join(universal, "iter_0000002"))) == \
        ["megatron_lite.json"] + [f"universal_layer_{i:02d}.pt" for i in range(6)]
    resumed, note = run_distributed(_train, 4, 2, 2, 1, ["--zero-stage", "0"], None, universal)[0]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    assert "random generators reseeded from --seed" in note


def test_vocabulary_rows_follow_the_padding_of_the_new_tp_for_weights_and_moments(tmp_path):
    ckpt, four = str(tmp_path / "ckpt"), str(tmp_path / "tp4")
    vocab = ["--vocab-size", "40", "--make-vocab-size-divisible-by", "32"]  # pads to 64 at TP 1, 128 at TP 4
    run_distributed(_train, 2, 1, 1, 2, ["--zero-stage", "1", *vocab], ckpt)
    run_tool("tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save", four,
             "--target-tensor-model-parallel-size", "4", "--target-pipeline-model-parallel-size", "1")
    before, after = _layout_free(ckpt).read(), _layout_free(four).read()
    for field in ("fp32", "exp_avg", "exp_avg_sq"):
        old, new = getattr(before[(0, "word_embeddings.weight")], field), getattr(after[(0, "word_embeddings.weight")], field)
        assert old.shape[0] == 64 and new.shape[0] == 128
        assert torch.equal(new[:64], old) and not new[64:].any(), field
    back = str(tmp_path / "back")
    run_tool("tools/convert_checkpoint.py", "reshard", "--load", four, "--save", back,
             "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1")
    assert torch.equal(_layout_free(back).read()[(0, "word_embeddings.weight")].exp_avg,
                       before[(0, "word_embeddings.weight")].exp_avg)
    # and --load at TP 4 takes the same rows itself
    resumed, note = run_distributed(_train, 4, 4, 1, 1, ["--zero-stage", "1", *vocab], None, ckpt)[0]
    assert sorted(resumed) == [3, 4] and "-> TP 4 x PP 1 x DP 1 (ZeRO 1, fp32)" in note


def test_a_partial_checkpoint_is_refused_naming_the_missing_file_and_nothing_is_written(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 2, 1, 1, 2, ["--zero-stage", "1"], ckpt)
    os.remove(os.path.join(ckpt, "iter_0000002", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    for command, target in (("universal", ["--save", str(tmp_path / "u")]),
                            ("reshard", ["--save", str(tmp_path / "r"), "--target-tensor-model-parallel-size", "2",
                                         "--target-pipeline-model-parallel-size", "1"])):
        line = error_line(run_tool("tools/convert_checkpoint.py", command, "--load", ckpt, *target, check=False))
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in line and "data-parallel size 2" in line
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_zero_2_checkpoint_is_refused_by_the_converters(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 2, 1, 1, 2, ["--zero-stage", "2"], ckpt)
    line = error_line(run_tool("tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save",
                               str(tmp_path / "u"), check=False))
    assert "was written with --zero-stage 2" in line and "resumes only under its own layout" in line
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
