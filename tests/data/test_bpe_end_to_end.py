"""A GPT-2 BPE and a Hugging Face tokenizer through every tool: preprocess, train, evaluate, generate; and the
checkpoint tools' one line for a tokenizer file that is no longer there (pretrain_gpt.py's and
preprocess_data.py's: tests/test_tokenizer_flags.py, tests/data/test_bpe_tokenizers.py)."""
import os
import shutil

import pytest

from megatron_lite.data.tokenizer import build_tokenizer
from tests.entry_points import run_script

pytestmark = pytest.mark.slow

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "1",
         "--eval-interval", "1000", "--split", "80,20,0", "--num-workers", "0", "--log-interval", "1"]


def run(script, *args):
    """The script as one process (a warm rank for the scripts that import torch: tests/entry_points.py)."""
    return run_script(script, *args)


def ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def error_line(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_preprocess_train_evaluate_and_generate_with_the_tokenizer_then_refuse_its_missing_files(bpe_files, tmp_path,
                                                                                              kind):
    tokenizer_dir = shutil.copytree(os.path.dirname(bpe_files["vocab_file"] if kind == "GPT2BPETokenizer"
                                                    else bpe_files["hf"] + "/"), tmp_path / "tokenizer")
    flags = (["--vocab-file", tokenizer_dir / "vocab.json", "--merge-file", tokenizer_dir / "merges.txt"]
             if kind == "GPT2BPETokenizer" else ["--tokenizer-model", tokenizer_dir])
    ok(run("tools/preprocess_data.py", "--input", bpe_files["corpus"], "--output-prefix", tmp_path / "corpus",
           "--tokenizer-type", kind, *flags, "--append-eod"))
    data = tmp_path / "corpus_text_document"
    trained = ok(run("pretrain_gpt.py", *MODEL, "--data-path", data, *flags, "--save", tmp_path / "ckpt"))
    tokenizer = build_tokenizer(kind, str(tokenizer_dir), None, str(tokenizer_dir / "vocab.json"),
                                str(tokenizer_dir / "merges.txt"))
    assert f"vocabulary {tokenizer.vocab_size} padded to 640" in trained.stdout + trained.stderr
    ok(run("tools/evaluate.py", "--load", tmp_path / "ckpt"))
    generated = ok(run("tools/generate.py", "--load", tmp_path / "ckpt", "--prompt", "the model", "--max-new-tokens",
                       4, "--no-stop-at-eod"))
    assert "generated 4 tokens after a" in generated.stderr

    # export-hf carries the run's tokenizer files: transformers reads them and gives our ids.
    import transformers

    ok(run("tools/convert_checkpoint.py", "export-hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the model reads  some text\n"
    assert theirs(text, add_special_tokens=kind == "HuggingFaceTokenizer")["input_ids"] == list(tokenizer.tokenize(text))
    hf_config = __import__("json").loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == (tokenizer.eod if tokenizer.eod >= 0 else None)

    moved = tmp_path / "moved"
    os.rename(tokenizer_dir, moved)
    missing = (tokenizer_dir / "vocab.json") if kind == "GPT2BPETokenizer" else tokenizer_dir
    flag = "--vocab-file" if kind == "GPT2BPETokenizer" else "--tokenizer-model"
    # Each reader names the file the checkpoint records and the flag that gives its new place (issue 61, class 9:
    # generate.py said "train one with tools/train_tokenizer.py").
    moved_file = f"was trained with {flag} {missing}, which is not there any more: give its new place with {flag} PATH"
    for command in (("tools/convert_checkpoint.py", "export-hf", "--load", tmp_path / "ckpt", "--output",
                     tmp_path / "hf2"), ("tools/generate.py", "--load", tmp_path / "ckpt", "--prompt", "x"),
                    ("tools/evaluate.py", "--load", tmp_path / "ckpt")):
        assert moved_file in error_line(run(*command)), command
    # The files given in their new place: generate reads them instead of the run's.
    given = (["--vocab-file", moved / "vocab.json", "--merge-file", moved / "merges.txt"]
             if kind == "GPT2BPETokenizer" else ["--tokenizer-model", moved])
    ok(run("tools/generate.py", "--load", tmp_path / "ckpt", "--prompt", "x", "--max-new-tokens", 2, *given))
