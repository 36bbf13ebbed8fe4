"""Bad input to the tools: one clear line naming the file or feature, exit 2, nothing written at the target."""
import os
import shutil

import pytest

from tests.checkpoint.conftest import copy_checkpoint, edited_copy, run_tool

pytestmark = pytest.mark.slow


def _error(result):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if "error:" in l]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_truncated_layer_file_is_named_and_nothing_is_written(run22, tmp_path):
    ckpt = copy_checkpoint(run22["ckpt"], tmp_path / "ckpt")
    layer = os.path.join(ckpt, "iter_0000004", "layer_02-model_01-model_states.pt")
    with open(layer, "r+b") as f:
        f.truncate(os.path.getsize(layer) // 2)
    merged = tmp_path / "model.pt"
    line = _error(run_tool("tools/convert_checkpoint.py", "merge", "--load", ckpt, "--output", str(merged), check=False))
    assert "layer_02-model_01-model_states.pt" in line and "truncated" in line
    assert not merged.exists()
    target = tmp_path / "resharded"
    line = _error(run_tool("tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save", str(target),
                           "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
                           check=False))
    assert "layer_02-model_01-model_states.pt" in line
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_missing_latest_is_named(run22, tmp_path):
    ckpt = copy_checkpoint(run22["ckpt"], tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "latest"))
    out = tmp_path / "hf"
    line = _error(run_tool("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", str(out),
                           check=False))
    assert os.path.join(ckpt, "latest") in line and "--iteration" in line
    assert not out.exists()


def test_a_missing_layer_file_and_a_file_of_another_model_are_named(run22, rope_run, tmp_path):
    ckpt = copy_checkpoint(run22["ckpt"], tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "iter_0000004", "layer_03-model_00-model_states.pt"))
    line = _error(run_tool("tools/convert_checkpoint.py", "merge", "--load", ckpt, "--output",
                           str(tmp_path / "a.pt"), check=False))
    assert "missing layer_03-model_00-model_states.pt" in line

    other = copy_checkpoint(run22["ckpt"], tmp_path / "other")
    foreign = os.path.join(rope_run, "iter_0000001", "layer_01-model_00-model_states.pt")
    # a transformer layer of the TP 1 rotary model where this TP 2 model's layer 1 belongs
    shutil.copy2(foreign, os.path.join(other, "iter_0000004", "layer_01-model_00-model_states.pt"))
    line = _error(run_tool("tools/convert_checkpoint.py", "merge", "--load", other, "--output",
                           str(tmp_path / "b.pt"), check=False))
    assert "layer_01-model_00-model_states.pt" in line and "another model" in line
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


def test_export_of_a_rotary_model_is_refused_naming_the_feature(rope_run, tmp_path):
    out = tmp_path / "hf"
    line = _error(run_tool("tools/convert_checkpoint.py", "export-hf", "--load", rope_run, "--output", str(out),
                           check=False))
    assert "--position-embedding-type rope" in line and "GPT2LMHeadModel" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_export_of_a_partly_llama_shaped_block_is_refused_naming_the_missing_flags():
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.checkpoint.hf_llama import check_llama
    from tests.model.gpt_layouts import tiny_config

    # SwiGLU and grouped-query attention but LayerNorm, biases and learned positions: neither GPT-2 nor Llama
    config = tiny_config(extra=("--swiglu", "--group-query-attention", "--num-query-groups", "2"))
    with pytest.raises(CheckpointError, match=r"without --normalization RMSNorm, --disable-bias-linear, "
                                              r"--position-embedding-type rope"):
        check_llama(config.model)


def test_reshard_never_writes_over_an_existing_folder(run22, tmp_path):
    target = tmp_path / "exists"
    target.mkdir()
    line = _error(run_tool("tools/convert_checkpoint.py", "reshard", "--load", run22["ckpt"], "--save", str(target),
                           "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
                           check=False))
    assert "already exists" in line and list(target.iterdir()) == []


def test_merge_never_writes_over_an_existing_file(zero1_run, tmp_path):
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"precious")
    line = _error(run_tool("tools/convert_checkpoint.py", "merge", "--load", zero1_run, "--output", str(existing),
                           check=False))
    assert "already exists" in line and existing.read_bytes() == b"precious"


def test_reshard_to_tensor_parallel_size_0_is_a_clear_error(zero1_run, tmp_path):
    line = _error(run_tool("tools/convert_checkpoint.py", "reshard", "--load", zero1_run, "--save",
                           str(tmp_path / "out"), "--target-tensor-model-parallel-size", "0",
                           "--target-pipeline-model-parallel-size", "1", "--no-optimizer", check=False))
    assert "--target-tensor-model-parallel-size: must be at least 1, got 0" in line and not (tmp_path / "out").exists()


def test_generate_with_a_tokenizer_of_another_vocabulary_is_refused(zero1_run, tmp_path):
    import sentencepiece

    jsonl = tmp_path / "text.jsonl"
    run_tool("tools/make_corpus.py", "--output", str(jsonl), "--max-docs", "40")
    run_tool("tools/train_tokenizer.py", "--input", str(jsonl), "--vocab-size", "600", "--model-prefix",
             str(tmp_path / "big"))
    assert sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "big.model")).vocab_size() == 600
    line = _error(run_tool("tools/generate.py", "--load", zero1_run, "--tokenizer-model", str(tmp_path / "big.model"),
                           "--prompt", "def", check=False))
    assert "has 600 pieces, but the model" in line and "vocabulary of 400" in line


def test_generate_with_a_tokenizer_folder_under_sentencepiece_says_it_is_a_folder_of_another_type(zero1_run,
                                                                                                  tmp_path):
    folder = tmp_path / "bpe"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    line = _error(run_tool("tools/generate.py", "--load", zero1_run, "--tokenizer-model", str(folder), "--prompt",
                           "def", check=False))
    assert f"--tokenizer-model {folder} is a folder" in line and "HuggingFaceTokenizer" in line, line


def test_a_killed_reshards_temporary_folder_is_removed_by_the_next_reshard(zero1_run, tmp_path):
    import subprocess
    import sys

    from megatron_lite.atomic import temporary_name

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    target = tmp_path / "out"
    leftover = temporary_name(str(target)).replace(f"-{os.getpid()}-", f"-{dead}-")
    os.makedirs(os.path.join(leftover, "iter_0000002"))
    with open(os.path.join(leftover, "iter_0000002", "layer_00-model_00-model_states.pt"), "wb") as f:
        f.write(b"\0" * 100_000)
    run_tool("tools/convert_checkpoint.py", "reshard", "--load", zero1_run, "--save", str(target),
             "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
             "--no-optimizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_generate_with_the_recorded_tokenizer_moved_names_the_recorded_file_and_the_flag_to_give(zero1_run, tmp_path):
    """Issue 61, class 9: before, "train one with tools/train_tokenizer.py", as if there had never been one."""
    moved = str(tmp_path / "gone" / "tokenizer.model")
    ckpt = edited_copy(zero1_run, tmp_path / "ckpt", "data", tokenizer_model=moved)
    line = _error(run_tool("tools/generate.py", "--load", ckpt, "--prompt", "def", check=False))
    assert line.endswith(f"the model in {ckpt} was trained with --tokenizer-model {moved}, which is not there any "
                         f"more: give its new place with --tokenizer-model PATH"), line


WRONG_KINDS = {  # issue 61, class 9: before, each was "no such folder" or "has no config.json" for a path that exists
    "import-hf --input a file": (lambda t: ("tools/convert_checkpoint.py", "import-hf", "--input", t / "file",
                                            "--output", t / "out"), "--input {t}/file is a file, not a folder"),
    "import-hf config.json a folder": (lambda t: ("tools/convert_checkpoint.py", "import-hf", "--input", t / "hf",
                                                  "--output", t / "out"),
                                       "--input {t}/hf: its config.json is a folder, not the model's JSON file"),
    "evaluate --load a file": (lambda t: ("tools/evaluate.py", "--load", t / "file"),
                               "--load {t}/file is a file, not a checkpoint folder"),
    "merge --load a file": (lambda t: ("tools/convert_checkpoint.py", "merge", "--load", t / "file", "--output",
                                       t / "out.pt"), "--load {t}/file is a file, not a checkpoint folder"),
}


@pytest.mark.parametrize("case", list(WRONG_KINDS))
def test_a_path_of_the_wrong_kind_is_named_as_what_it_is_not_as_missing(case, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "hf" / "config.json").mkdir(parents=True)
    command, says = WRONG_KINDS[case]
    line = _error(run_tool(*command(tmp_path), check=False))
    assert says.format(t=tmp_path) in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()
