"""GPT2BPETokenizer and HuggingFaceTokenizer against transformers' tokenizers of the same files."""
import hashlib
import json
import os
import shutil

import pytest
from transformers import AutoTokenizer, GPT2TokenizerFast

from megatron_lite.data.sidecar import tokenizer_sha256
from megatron_lite.data.tokenizer import build_tokenizer, tokenizer_files
from tests.data.bpe_files import BOS, EOD, write_hf_folder
from tests.data.conftest import run_tool

EXTRA = ["", " ", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "\x1c\x1d\x1e\x1f \x85 \xa0", "ǅ ª ² Ⅻ 𝟙",
         "e\u0301 \ufeff \u200b", "never seen: Ωμέγα Ж ع 🦀", "\x00"]


def gpt2(bpe_files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files["vocab_file"], merge_file=bpe_files["merge_file"])


def test_gpt2_bpe_gives_the_ids_of_transformers_gpt2_tokenizer_from_the_same_files(bpe_files):
    ours = gpt2(bpe_files)
    theirs = GPT2TokenizerFast(vocab=bpe_files["vocab_file"], merges=bpe_files["merge_file"])
    texts = [t for t in bpe_files["texts"] + EXTRA if EOD not in t]
    assert [ours.tokenize(t) for t in texts] == [theirs(t).input_ids for t in texts]
    assert [ids.tolist() for ids in ours.tokenize_batch(texts)] == [theirs(t).input_ids for t in texts]
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == (len(theirs), theirs.convert_tokens_to_ids(EOD), -1, -1)
    assert all(ours.detokenize(ours.tokenize(t)) == t for t in texts)


def test_gpt2_bpe_reads_endoftext_in_text_as_plain_text_as_megatron_lm_does(bpe_files):
    ours = gpt2(bpe_files)
    theirs = GPT2TokenizerFast(vocab=bpe_files["vocab_file"], merges=bpe_files["merge_file"], split_special_tokens=True)
    text = f"one{EOD}two {EOD}"
    assert ours.tokenize(text) == theirs(text).input_ids and ours.eod not in ours.tokenize(text)


@pytest.mark.parametrize("given", ["folder", "tokenizer.json"])
def test_hugging_face_tokenizer_gives_autotokenizer_ids_with_its_bos_and_eos(bpe_files, given):
    folder = bpe_files["hf"]
    ours = build_tokenizer("HuggingFaceTokenizer", folder if given == "folder" else os.path.join(folder, given))
    theirs = AutoTokenizer.from_pretrained(folder)
    texts = bpe_files["texts"] + EXTRA
    assert [ours.tokenize(t) for t in texts] == [theirs(t).input_ids for t in texts]
    assert [ids.tolist() for ids in ours.tokenize_batch(texts)] == [theirs(t).input_ids for t in texts]
    assert ours.tokenize("x")[0] == theirs.convert_tokens_to_ids(BOS)  # the tokenizer.json's post-processor
    assert (ours.vocab_size, ours.eod, ours.bos) == (len(theirs), theirs.eos_token_id, theirs.bos_token_id)
    assert ours.pad == -1 and theirs.pad_token_id is None
    assert [ours.detokenize(ours.tokenize(t)) for t in texts] == [theirs.decode(theirs(t).input_ids) for t in texts]


def test_special_tokens_map_names_eos_over_tokenizer_config_as_in_transformers(bpe_files, tmp_path):
    folder = write_hf_folder(tmp_path / "hf", bpe_files["vocab_file"], bpe_files["merge_file"],
                             config={"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD})
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": {"content": BOS}, "pad_token": EOD}, f)
    ours, theirs = build_tokenizer("HuggingFaceTokenizer", folder), AutoTokenizer.from_pretrained(folder)
    assert (ours.eod, ours.pad) == (theirs.eos_token_id, theirs.pad_token_id) == (theirs.convert_tokens_to_ids(BOS),
                                                                                  theirs.convert_tokens_to_ids(EOD))


def test_a_tokenizer_json_without_named_eos_has_no_eod_and_preprocess_refuses_append_eod(bpe_files, tmp_path):
    folder = write_hf_folder(tmp_path / "hf", bpe_files["vocab_file"], bpe_files["merge_file"], config=False)
    assert build_tokenizer("HuggingFaceTokenizer", folder).eod == -1
    assert AutoTokenizer.from_pretrained(folder).eos_token_id is None
    proc = run_tool("preprocess_data.py", "--input", bpe_files["corpus"], "--output-prefix", tmp_path / "out",
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder, "--append-eod",
                    check=False)
    assert proc.returncode == 2 and "--append-eod needs an end-of-document token" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("flag", ["--vocab-file", "--merge-file", "--tokenizer-model"])
def test_a_missing_or_unreadable_tokenizer_file_is_an_error_naming_the_flag_and_the_file(bpe_files, tmp_path, flag):
    files = {"--vocab-file": bpe_files["vocab_file"], "--merge-file": bpe_files["merge_file"],
             "--tokenizer-model": bpe_files["hf"]}
    kind = "HuggingFaceTokenizer" if flag == "--tokenizer-model" else "GPT2BPETokenizer"

    def build(path):
        given = {**files, flag: str(path)}
        return build_tokenizer(kind, given["--tokenizer-model"], None, given["--vocab-file"], given["--merge-file"])

    with pytest.raises(FileNotFoundError, match=f"^{flag} {tmp_path}/missing: no such file"):
        build(tmp_path / "missing")
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\xfe not a tokenizer file")
    with pytest.raises(ValueError, match=f"^{flag} {garbage}: not (a|UTF-8 text)"):
        build(garbage)


def test_a_hugging_face_folder_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^--tokenizer-model {tmp_path}: the folder has no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_tokenizer_files_name_the_files_an_export_copies(bpe_files, spm_model, tmp_path):
    folder = shutil.copytree(bpe_files["hf"], tmp_path / "hf")
    assert tokenizer_files("SentencePieceTokenizer", spm_model) == [(spm_model, "tokenizer.model")]
    assert tokenizer_files("HuggingFaceTokenizer", str(folder)) == [
        (str(folder / "tokenizer.json"), "tokenizer.json"), (str(folder / "tokenizer_config.json"), "tokenizer_config.json")]
    (folder / "special_tokens_map.json").write_text("{}")
    assert [name for _, name in tokenizer_files("HuggingFaceTokenizer", str(folder / "tokenizer.json"))] == [
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert tokenizer_files("GPT2BPETokenizer", None, bpe_files["vocab_file"], bpe_files["merge_file"]) == [
        (bpe_files["vocab_file"], "vocab.json"), (bpe_files["merge_file"], "merges.txt")]
    assert tokenizer_files("NullTokenizer") == []


def test_the_tokenizer_identity_is_the_sha256_of_the_files_that_decide_the_ids(bpe_files, spm_model, tmp_path):
    def sha(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()

    vocab, merges = bpe_files["vocab_file"], bpe_files["merge_file"]
    assert tokenizer_sha256("SentencePieceTokenizer", spm_model) == sha(spm_model)  # as sidecars always recorded
    assert tokenizer_sha256("HuggingFaceTokenizer", bpe_files["hf"]) == sha(os.path.join(bpe_files["hf"],
                                                                                         "tokenizer.json"))
    pair = f"vocab.json {sha(vocab)}\nmerges.txt {sha(merges)}\n".encode()
    assert tokenizer_sha256("GPT2BPETokenizer", None, vocab, merges) == hashlib.sha256(pair).hexdigest()
    other = tmp_path / "merges.txt"
    other.write_text(open(merges, encoding="utf-8").read() + "a b\n", encoding="utf-8")
    assert tokenizer_sha256("GPT2BPETokenizer", None, vocab, str(other)) != tokenizer_sha256(
        "GPT2BPETokenizer", None, vocab, merges)
    assert tokenizer_sha256("NullTokenizer") is None


def test_train_tokenizer_writes_a_byte_level_bpe_that_transformers_and_ours_read_alike(bpe_files, tmp_path):
    for name in ("a", "b"):
        run_tool("train_tokenizer.py", "--input", bpe_files["corpus"], "--model-type", "byte-level-bpe",
                 "--vocab-size", 400, "--model-prefix", tmp_path / name, "--num-threads", 1 if name == "a" else 2)
    folder = tmp_path / "a"
    assert sorted(os.listdir(folder)) == ["merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    assert all((folder / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in os.listdir(folder))
    hf = build_tokenizer("HuggingFaceTokenizer", str(folder))
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=str(folder / "vocab.json"),
                          merge_file=str(folder / "merges.txt"))
    auto = AutoTokenizer.from_pretrained(folder)
    gpt2_fast = GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    texts = [t for t in bpe_files["texts"] + EXTRA if EOD not in t]
    assert [hf.tokenize(t) for t in texts] == [auto(t).input_ids for t in texts] == \
        [bpe.tokenize(t) for t in texts] == [gpt2_fast(t).input_ids for t in texts]
    assert hf.vocab_size == bpe.vocab_size == len(auto) == 400
    assert hf.eod == bpe.eod == auto.eos_token_id == 0
    assert hf.tokenize(EOD) == [0] and bpe.tokenize(EOD) != [0]  # a special token in tokenizer.json only


def test_train_tokenizer_refuses_a_byte_level_vocabulary_smaller_than_its_alphabet(bpe_files, tmp_path):
    proc = run_tool("train_tokenizer.py", "--input", bpe_files["corpus"], "--model-type", "byte-level-bpe",
                    "--vocab-size", 200, "--model-prefix", tmp_path / "tok", check=False)
    assert proc.returncode == 2 and "--vocab-size 200 is too small" in proc.stderr and os.listdir(tmp_path) == []
