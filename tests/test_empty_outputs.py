"""An output flag that names nothing or a folder, an output on a read-only file system, and an input that holds
nothing: each is refused before the tool reads or writes anything, exit 2 with one line naming the flag and what
would work; nothing is written, in the folder given or in the current one.

The tools' main() runs in this process (tests/tool_calls.py); the inputs of the cases refused for their output
need not exist.
"""
import os

import pytest

from tests import tool_calls
from tests.data.corpus_mix import load_tool
from tests.tmpfs import remount_read_only, small_tmpfs
from tests.tool_calls import snapshot

TOOLS = {name: load_tool(name) for name in ("train_tokenizer", "preprocess_data", "merge_datasets", "make_corpus",
                                            "convert_checkpoint", "synthetic_data")}
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]

# (tool, argv with {target}, {folder} (an existing folder) and {missing}, the flag, words the line must hold)
CASES = [
    ("preprocess_data", ["--input", "{missing}", "--output-prefix", "", *NULL], "--output-prefix", "is empty"),
    ("train_tokenizer", ["--input", "{missing}", "--model-prefix", ""], "--model-prefix", "is empty"),
    ("train_tokenizer", ["--input", "{missing}", "--model-prefix", "", "--model-type", "byte-level-bpe"],
     "--model-prefix", "is empty"),
    ("merge_datasets", ["--input", "{missing}", "--output-prefix", ""], "--output-prefix", "is empty"),
    ("make_corpus", ["--output", ""], "--output", "is empty"),
    ("convert_checkpoint", ["merge", "--load", "{missing}", "--output", ""], "--output", "is empty"),
    ("convert_checkpoint", ["export-hf", "--load", "{missing}", "--output", ""], "--output", "is empty"),
    ("convert_checkpoint", ["import-hf", "--input", "{missing}", "--output", ""], "--output", "is empty"),
    ("convert_checkpoint", ["reshard", "--load", "{missing}", "--save", "", "--target-tensor-model-parallel-size",
                            "1", "--target-pipeline-model-parallel-size", "1"], "--save", "is empty"),
    ("convert_checkpoint", ["universal", "--load", "{missing}", "--save", ""], "--save", "is empty"),
    ("synthetic_data", ["--output-dir", "", "--vocab-size", "128"], "--output-dir", "is empty"),
    ("preprocess_data", ["--input", "{missing}", "--output-prefix", "{folder}", *NULL], "--output-prefix",
     "is a folder"),
    ("preprocess_data", ["--input", "{missing}", "--output-prefix", "{missing}/", *NULL], "--output-prefix",
     "is a folder"),
    ("merge_datasets", ["--input", "{missing}", "--output-prefix", "{folder}"], "--output-prefix", "is a folder"),
    ("train_tokenizer", ["--input", "{missing}", "--model-prefix", "{folder}"], "--model-prefix", "is a folder"),
]


def _id(case):
    argv = " ".join(a if a else '""' for a in case[1] if a not in NULL)
    return f"{case[0]} {argv}".replace("{missing}", "M").replace("{folder}", "D")


@pytest.mark.parametrize("tool,argv,flag,words", CASES, ids=[_id(c) for c in CASES])
def test_an_empty_or_folder_output_is_refused_naming_the_flag_and_nothing_is_written(tool, argv, flag, words,
                                                                                    tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)  # an empty prefix wrote hidden files (".bin", ".model") here
    before = snapshot(tmp_path)
    paths = {"missing": str(tmp_path / "missing"), "folder": str(folder)}
    line = tool_calls.refusal(TOOLS[tool].main, [a.format(**paths) for a in argv])
    assert flag in line and words in line, line
    assert snapshot(tmp_path) == before


def test_synthetic_data_on_a_read_only_file_system_is_refused_naming_the_flag(tmp_path):
    with small_tmpfs(tmp_path / "ro", 1 << 20) as mounted:
        remount_read_only(mounted)
        target = os.path.join(mounted, "data")
        line = tool_calls.refusal(TOOLS["synthetic_data"].main, ["--output-dir", target, "--vocab-size", "128"])
        assert f"--output-dir {target}" in line and "Read-only file system" in line, line
        assert os.listdir(mounted) == []


def test_make_corpus_refuses_a_root_without_python_files_and_writes_no_corpus(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("no code here\n")
    output = tmp_path / "corpus.jsonl"
    line = tool_calls.refusal(TOOLS["make_corpus"].main, ["--root", root, "--output", output])
    assert f"--root {root}" in line and ".py" in line, line
    assert not output.exists()


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank lines"])
@pytest.mark.parametrize("vocab", ["8000", "261"])  # 261: what a --vocab-size 10 refusal suggests
def test_train_tokenizer_refuses_an_input_without_text_before_sentencepiece_runs(text, vocab, tmp_path):
    corpus = tmp_path / "empty.txt"
    corpus.write_text(text)
    before = snapshot(tmp_path)
    line = tool_calls.refusal(TOOLS["train_tokenizer"].main, ["--input", corpus, "--model-prefix", tmp_path / "tok",
                                                             "--vocab-size", vocab])
    assert f"--input {corpus}" in line and "no text" in line, line
    assert snapshot(tmp_path) == before
