"""The data tools refuse every bad number and every clash of flags before they read or write anything: exit 2,
one line naming the flag and a value that works. Files they parse (a dataset's sidecar) are refused in one line
naming the flag and the file; an --overwrite replaces an output whole or, when its write fails, not at all.

The tools' main() runs in this process (tests/data/corpus_mix.py's load_tool): argparse's refusals, and the
tool's own ones, come before any input is opened, so the inputs of the refused cases need not exist.
"""
import errno
import json
import os
import re

import pytest

from megatron_lite.atomic import AtomicFile, WriteError
from tests import tool_calls
from tests.data.corpus_mix import load_tool
from tests.tool_calls import hidden, snapshot

TOOLS = {name: load_tool(name) for name in ("train_tokenizer", "preprocess_data", "merge_datasets", "make_corpus",
                                            "synthetic_data")}


def call(tool, *argv):
    """(exit status, stdout, stderr) of tools/<tool>.py's main(argv) in this process."""
    return tool_calls.call(TOOLS[tool].main, argv)


def refused(tool, *argv):
    """The one error line of a refusal (exit 2, no traceback), which names the tool."""
    line = tool_calls.refusal(TOOLS[tool].main, argv)
    assert line.startswith(f"{tool}.py: error: "), line
    return line


# Refused by every numeric flag: not finite, a fraction where a count is meant or out of range, and huge.
ALWAYS_BAD = ["nan", "inf", "-inf", "1e30", "99999999999999"]

# tool -> (argv the tool otherwise accepts, {flag: its own out-of-range values (below its minimum, 0 where 0
# is not allowed, above its maximum)}). {missing}: an input that does not exist; {out}: an output not there yet.
NUMBERS = {
    "train_tokenizer": (["--input", "{missing}", "--model-prefix", "{out}"], {
        "--vocab-size": ["-1", "0", "1.5"],
        "--character-coverage": ["-1", "0", "0.5", "0.97", "1.5"],
        "--input-sentence-size": ["-1", "1.5"],
        "--max-sentence-length": ["-1", "0", "9", str((1 << 30) + 1)],
        "--pad-id": ["-2", "3.5"],
        "--num-threads": ["-1", "0", "1025"],
        "--seed-sentencepiece-size": ["-1", "0"],
    }),
    "preprocess_data": (["--input", "{missing}", "--output-prefix", "{out}", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "128"], {
        "--vocab-size": ["-1", "0", "1", "2.5"],
        "--num-shards": ["-1", "0", "2.5"],
        "--shard-index": ["-1", "0.5"],
        "--workers": ["-1", "0", "1025"],
        "--chunk-documents": ["-1", "0"],
        "--log-interval": ["-1", "0"],
    }),
    "make_corpus": (["--output", "{out}", "--root", "{missing}"], {
        "--max-docs": ["-1", "0", "2.5"],
        "--max-bytes": ["-1", "0"],
        "--min-doc-bytes": ["-1", "0.5"],
        "--max-doc-bytes": ["-1", "0"],
    }),
    "synthetic_data": (["--output-dir", "{out}", "--vocab-size", "128"], {
        "--vocab-size": ["-1", "0", "1", "2.5"],
        "--num-tokens": ["-1", "0"],
        "--seed": ["-1", "0.5"],
    }),
}


def _number_cases(tool):
    argv, flags = NUMBERS[tool]
    return [(argv, flag, value) for flag, own in flags.items() for value in ALWAYS_BAD + own]


def _refuses_the_number(tool, argv, flag, value, tmp_path):
    paths = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out")}
    before = snapshot(tmp_path)
    line = refused(tool, *[a.format(**paths) for a in argv], f"{flag}={value}")  # argparse reads -inf as a flag
    assert f"argument {flag}: must be" in line and f"got {value}; e.g. " in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv,flag,value", _number_cases("train_tokenizer"))
def test_every_numeric_flag_of_train_tokenizer_refuses_nan_inf_negative_zero_and_huge(argv, flag, value, tmp_path):
    _refuses_the_number("train_tokenizer", argv, flag, value, tmp_path)


@pytest.mark.parametrize("argv,flag,value", _number_cases("preprocess_data"))
def test_every_numeric_flag_of_preprocess_data_refuses_nan_inf_negative_zero_and_huge(argv, flag, value, tmp_path):
    _refuses_the_number("preprocess_data", argv, flag, value, tmp_path)


@pytest.mark.parametrize("argv,flag,value", _number_cases("make_corpus"))
def test_every_numeric_flag_of_make_corpus_refuses_nan_inf_negative_zero_and_huge(argv, flag, value, tmp_path):
    _refuses_the_number("make_corpus", argv, flag, value, tmp_path)


@pytest.mark.parametrize("argv,flag,value", _number_cases("synthetic_data"))
def test_every_numeric_flag_of_synthetic_data_refuses_nan_inf_negative_zero_and_huge(argv, flag, value, tmp_path):
    _refuses_the_number("synthetic_data", argv, flag, value, tmp_path)


def test_every_numeric_flag_of_the_data_tools_is_in_the_tables_and_goes_through_add_number():
    """A numeric flag added later without a row here, or read with a bare int() (which takes nan for a float
    and -1 for a count), fails this test."""
    for tool in TOOLS:
        actions = [a for a in TOOLS[tool].build_parser()._actions if a.option_strings]
        numeric = {a.option_strings[-1] for a in actions if a.type in (int, float) or _checked(a)}
        assert numeric == set(NUMBERS.get(tool, (None, {}))[1]), tool
        assert all(_checked(a) for a in actions if a.type in (int, float) or _checked(a)), tool


def _checked(action):
    """Whether the flag's type is flag_numbers.number()'s."""
    return getattr(action.type, "__qualname__", "").startswith("number.")


# Flags each in range that do not fit together (or the tool's own needs): refused before the input is read.
CLASHES = [
    ("train_tokenizer", ["--pad-id", "1"], ["--pad-id 1 is bos's id", "use 3, or -1"]),
    ("train_tokenizer", ["--pad-id", "500", "--vocab-size", "400"], ["--pad-id 500 is outside --vocab-size 400"]),
    ("train_tokenizer", ["--vocab-size", "260"], ["--vocab-size 260 is too small", "use 261 or more"]),
    ("train_tokenizer", ["--vocab-size", "3", "--no-byte-fallback"], ["--vocab-size 3 is too small", "use 5 or more"]),
    ("train_tokenizer", ["--vocab-size", "256", "--model-type", "byte-level-bpe"],
     ["--vocab-size 256 is too small for a byte-level BPE", "use 257 or more"]),
    ("train_tokenizer", ["--input-sentence-size", "100"], ["--input-sentence-size 100", "use 0 or 101 or more"]),
    ("preprocess_data", ["--num-shards", "4", "--shard-index", "4"],
     ["--shard-index 4 is outside [0, --num-shards 4)", "give 0 to 3"]),
    ("preprocess_data", ["--num-shards", "4"], ["--num-shards and --shard-index go together"]),
    ("make_corpus", ["--min-doc-bytes", "300", "--max-doc-bytes", "200"],
     ["--min-doc-bytes 300 is more than --max-doc-bytes 200", "at most 200"]),
]


@pytest.mark.parametrize("tool,extra,words", CLASHES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CLASHES])
def test_flags_that_do_not_fit_together_are_refused_naming_them_before_the_input_is_read(tool, extra, words,
                                                                                         tmp_path):
    paths = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out")}
    before = snapshot(tmp_path)
    line = refused(tool, *[a.format(**paths) for a in NUMBERS[tool][0]], *extra)
    assert all(word in line for word in words), line
    assert snapshot(tmp_path) == before


def test_train_tokenizer_vocab_size_0_exits_2_naming_the_flag_not_with_sentencepieces_message(corpus, tmp_path):
    """Issue 43, defect 10: SentencePiece's 'trainer_interface.cc(...) [insert_id(...)]' and exit 1 before."""
    code, out, err = call("train_tokenizer", "--input", corpus, "--model-prefix", tmp_path / "spm",
                          "--vocab-size", "0", "--num-threads", "1")
    assert code == 2 and "argument --vocab-size: must be at least 1, got 0; e.g. 32000" in err, (code, err)
    assert "trainer_interface" not in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_vocab_size_the_corpus_cannot_fill_is_refused_naming_the_flag_and_a_size_that_trains(corpus, tmp_path,
                                                                                               model_type):
    """Too few pieces for the corpus's characters, or more than it holds: known only once SentencePiece has read
    the corpus, and said with the flag and a size that then trains."""
    argv = ["--input", corpus, "--model-prefix", tmp_path / "spm", "--num-threads", "1", "--model-type", model_type]
    small = refused("train_tokenizer", *argv, "--vocab-size", "262")
    assert "--vocab-size 262 is too small for the characters of" in small and "trainer_interface" not in small
    large = refused("train_tokenizer", *argv, "--vocab-size", "100000")
    assert "--vocab-size 100000 is more pieces than SentencePiece finds in" in large
    assert os.listdir(tmp_path) == []
    fits = re.search(r"use (\d+) or more", small).group(1)
    assert call("train_tokenizer", *argv, "--vocab-size", fits)[0] == 0


def _null_dataset(tmp_path, name, text="1 2 3"):
    ids = tmp_path / f"{name}.jsonl"
    ids.write_text(json.dumps({"text": text}) + "\n")
    assert call("preprocess_data", "--input", ids, "--output-prefix", tmp_path / name, "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "128")[0] == 0
    return tmp_path / f"{name}_text_document"


@pytest.mark.parametrize("content,words", [
    (bytes([0x91, 0x00, 0xff, 0x13]) * 64, ["not UTF-8 text (byte 0x91 at offset 0)"]),
    (b'{"format": "megatron_lite.dataset", "version": 1, "dtype": ', ["not JSON"]),
    (None, ["field 'tokenizer' is None, not a dict"]),
], ids=["random bytes", "cut JSON", "field missing"])
def test_merge_datasets_refuses_an_unreadable_input_sidecar_in_one_line_naming_the_flag_and_file(tmp_path, content,
                                                                                                 words):
    first, second = _null_dataset(tmp_path, "a"), _null_dataset(tmp_path, "b", "4 5")
    sidecar = tmp_path / "b_text_document.json"
    if content is None:
        record = json.loads(sidecar.read_text())
        del record["tokenizer"]
        sidecar.write_text(json.dumps(record))
    else:
        sidecar.write_bytes(content)
    before = snapshot(tmp_path)
    line = refused("merge_datasets", "--input", first, second, "--output-prefix", tmp_path / "merged")
    assert f"--input {sidecar}: " in line and all(word in line for word in words), line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tool", ["make_corpus", "preprocess_data", "merge_datasets"])
def test_overwrite_replaces_a_data_tool_output_whole_and_leaves_no_temporary_behind(tool, tmp_path):
    if tool == "make_corpus":
        argv, written = ["--output", tmp_path / "corpus.jsonl", "--max-docs", "2", "--max-bytes", "100000"], \
            [tmp_path / "corpus.jsonl"]
        again = ["--max-docs", "3"]
    elif tool == "preprocess_data":
        ids = tmp_path / "in" / "ids.jsonl"
        ids.parent.mkdir()
        ids.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
        argv = ["--input", ids, "--output-prefix", tmp_path / "d", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "128"]
        written, again = [tmp_path / f"d_text_document{s}" for s in (".bin", ".idx", ".json")], ["--append-eod"]
    else:
        inputs = tmp_path / "in"
        inputs.mkdir()
        first, second = _null_dataset(inputs, "a"), _null_dataset(inputs, "b", "4 5")
        argv = ["--input", first, second, "--output-prefix", tmp_path / "m"]
        written, again = [tmp_path / f"m{s}" for s in (".bin", ".idx", ".json")], []
        argv_again = ["--input", second, first, "--output-prefix", tmp_path / "m"]
    assert call(tool, *argv)[0] == 0
    old = {path: path.read_bytes() for path in written}
    rerun = argv_again if tool == "merge_datasets" else [*argv, *again]
    line = refused(tool, *rerun)
    assert "already exists" in line and "--overwrite" in line, line
    assert {path: path.read_bytes() for path in written} == old
    assert call(tool, *rerun, "--overwrite")[0] == 0
    assert all(path.read_bytes() != old[path] for path in written)
    assert hidden(tmp_path) == []


def test_a_failed_overwrite_of_a_sentencepiece_model_leaves_the_previous_pair_as_it_was(corpus, tmp_path,
                                                                                       monkeypatch):
    """Both files are written in full before either is renamed: a full disk on the .model keeps the old .vocab."""
    argv = ["--input", corpus, "--num-threads", "1", "--model-prefix"]
    assert call("train_tokenizer", *argv, tmp_path / "spm", "--vocab-size", "400")[0] == 0
    assert call("train_tokenizer", *argv, tmp_path / "other", "--vocab-size", "500")[0] == 0
    other = (tmp_path / "other.model").read_bytes()
    before = snapshot(tmp_path)
    tool = TOOLS["train_tokenizer"]

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    class ModelOnAFullDisk(AtomicFile):
        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            if path.endswith(".model"):
                self.file = FullDisk(self.file)

    monkeypatch.setattr(tool, "AtomicFile", ModelOnAFullDisk)
    with pytest.raises(WriteError, match=r"spm\.model: No space left on device"):
        tool.publish(other, str(tmp_path / "spm"))
    assert snapshot(tmp_path) == before and hidden(tmp_path) == []


def test_synthetic_data_reuses_its_own_dataset_refuses_another_and_remakes_it_with_overwrite(tmp_path):
    out = tmp_path / "random"
    argv = ["--output-dir", out, "--vocab-size", "128", "--num-tokens", "3000"]
    code, printed, err = call("synthetic_data", *argv)
    assert code == 0, err
    assert printed.strip() == str(out / "data_text_document") and hidden(tmp_path) == []
    made = snapshot(tmp_path)
    assert call("synthetic_data", *argv)[0] == 0 and snapshot(tmp_path) == made  # the same flags: reused
    for extra, why in ((["--seed", "1"], "--seed 1"), (["--vocab-size", "256"], "not --vocab-size 256")):
        line = refused("synthetic_data", *argv, *extra)
        assert f"--output-dir {out} holds another dataset" in line and why in line and "--overwrite" in line, line
        assert snapshot(tmp_path) == made
    (out / "data_text_document.json").unlink()  # an unfinished dataset is not reused either
    assert "already exists" in refused("synthetic_data", *argv)
    assert call("synthetic_data", *argv, "--seed", "1", "--overwrite")[0] == 0
    assert (out / "data_text_document.bin").read_bytes() != made[str(out / "data_text_document.bin")]
    assert call("synthetic_data", *argv, "--seed", "1")[0] == 0 and hidden(tmp_path) == []
