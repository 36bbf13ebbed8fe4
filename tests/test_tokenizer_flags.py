"""The tokenizer flags of pretrain_gpt.py: which type they mean, the vocabulary it decides, and one line naming the
flag and the file for every tokenizer file that is missing or unusable, before any process group exists."""
import numpy as np
import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
from megatron_lite.data.sidecar import tokenizer_identity, tokenizer_sha256, write_sidecar
from megatron_lite.data.tokenizer import build_tokenizer
from megatron_lite.validation.resume import resume_differences
from tests.data.bpe_files import corpus_texts, write_gpt2_files, write_hf_folder

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4", "--eval-iters", "1",
        "--split", "80,20,0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    texts = corpus_texts(40)
    vocab, merges = write_gpt2_files(root / "gpt2", texts, merges_wanted=100)
    other_merges = root / "other_merges.txt"  # the same vocabulary, one merge fewer
    with open(merges, encoding="utf-8") as f:
        other_merges.write_text("".join(f.readlines()[:-1]), encoding="utf-8")
    return {"vocab": vocab, "merges": merges, "other_merges": str(other_merges),
            "hf": write_hf_folder(root / "hf", vocab, merges)}


def dataset_with_sidecar(prefix, kind, model=None, vocab=None, merges=None):
    """A small .bin/.idx pair whose sidecar says it was tokenized with these files (as preprocess_data.py writes)."""
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for i in range(40):
            writer.add_document(list(range(i, i + 40)))
    tokenizer = build_tokenizer(kind, model, None, vocab, merges)
    write_sidecar(str(prefix), {"tokenizer": tokenizer_identity(tokenizer, kind, tokenizer_sha256(kind, model, vocab,
                                                                                                   merges), True)})
    return str(prefix)


def gpt2_flags(files, merges=None):
    return ["--vocab-file", files["vocab"], "--merge-file", merges or files["merges"]]


def test_vocab_and_merge_files_mean_gpt2_bpe_and_decide_the_vocabulary(files):
    config, _ = parse_args(TINY + gpt2_flags(files), world_size=1)
    assert config.data.tokenizer_type == "GPT2BPETokenizer"
    assert config.model.vocab_size == 256 + 100 + 1 and config.model.padded_vocab_size == 384


@pytest.mark.parametrize("given", ["folder", "tokenizer.json"])
def test_a_tokenizer_folder_or_json_means_hugging_face_and_decides_the_vocabulary(files, given):
    path = files["hf"] if given == "folder" else f"{files['hf']}/tokenizer.json"
    config, _ = parse_args(TINY + ["--tokenizer-model", path], world_size=1)
    assert config.data.tokenizer_type == "HuggingFaceTokenizer" and config.model.vocab_size == 256 + 100 + 2


def test_a_vocab_size_that_disagrees_with_the_bpe_files_is_refused(files):
    with pytest.raises(ConfigError, match=r"^--vocab-size 400 disagrees with --vocab-file .* --merge-file .*, which "
                                          r"has 357 tokens; .*use --vocab-size 357\)$"):
        parse_args(TINY + gpt2_flags(files) + ["--vocab-size", "400"], world_size=1)


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}"],
     r"^--tokenizer-type GPT2BPETokenizer needs --vocab-file VOCAB.json and --merge-file MERGES.txt$"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{vocab}", "--merge-file", "{merges}"],
     r"^--merge-file \S+ is not read by --tokenizer-type SentencePieceTokenizer, which takes --tokenizer-model"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "100"],
     r"^--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model FOLDER"),
])
def test_tokenizer_flags_that_do_not_fit_the_type_are_refused(files, flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(TINY + [f.format(**files) for f in flags], world_size=1)


@pytest.mark.parametrize("flag", ["--tokenizer-model", "--vocab-file", "--merge-file"])
@pytest.mark.parametrize("problem", ["missing", "garbage"])
def test_a_missing_or_unusable_tokenizer_file_is_one_line_naming_the_flag_even_beside_a_sidecar(files, tmp_path, flag,
                                                                                            problem):
    # The sidecar is what made a missing --tokenizer-model a FileNotFoundError: the data section hashed the file
    # while the tokenizer section had already refused it.
    if flag == "--tokenizer-model":
        data = dataset_with_sidecar(tmp_path / "data_text_document", "HuggingFaceTokenizer", model=files["hf"])
        given = {"--tokenizer-model": None}
    else:
        data = dataset_with_sidecar(tmp_path / "data_text_document", "GPT2BPETokenizer", vocab=files["vocab"],
                                    merges=files["merges"])
        given = {"--vocab-file": files["vocab"], "--merge-file": files["merges"]}
    bad = tmp_path / ("missing.json" if problem == "missing" else "garbage.json")
    if problem == "garbage":
        bad.write_bytes(b"\xff\xfe not a tokenizer file")
    given[flag] = str(bad)
    argv = TINY + ["--data-path", data] + [a for pair in given.items() for a in pair]
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world_size=1)
    assert "\n" not in str(info.value)
    expected = ("no such file",) if problem == "missing" else ("not a", "not UTF-8 text")
    assert str(info.value).startswith(tuple(f"{flag} {bad}: {e}" for e in expected)), info.value


def test_data_tokenized_with_other_bpe_files_is_refused_naming_them(files, tmp_path):
    data = dataset_with_sidecar(tmp_path / "data_text_document", "GPT2BPETokenizer", vocab=files["vocab"],
                                merges=files["merges"])
    parse_args(TINY + ["--data-path", data] + gpt2_flags(files), world_size=1)
    with pytest.raises(ConfigError, match=rf"^--data-path {data} was tokenized with a vocab.json \+ merges.txt of "
                                          rf"SHA-256 \w{{12}}\.\.\., but --vocab-file \S+ --merge-file "
                                          rf"{files['other_merges']} are \w{{12}}"):
        parse_args(TINY + ["--data-path", data] + gpt2_flags(files, files["other_merges"]), world_size=1)


def test_a_resume_with_other_bpe_files_is_refused_naming_them(files):
    saved, _ = parse_args(TINY + gpt2_flags(files), world_size=1)
    new, _ = parse_args(TINY + gpt2_flags(files, files["other_merges"]), world_size=1)
    before = tokenizer_sha256("GPT2BPETokenizer", None, files["vocab"], files["merges"])
    after = tokenizer_sha256("GPT2BPETokenizer", None, files["vocab"], files["other_merges"])
    problems = resume_differences(saved, new.replace(model__vocab_size=saved.model.vocab_size), before, after)
    assert problems == [f"--vocab-file: checkpoint trained with a model of SHA-256 {before[:12]}..., this run's "
                        f"--vocab-file {files['vocab']} --merge-file {files['other_merges']} are {after[:12]}..."]
