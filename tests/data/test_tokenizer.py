import pytest
import sentencepiece

from megatron_lite.data.tokenizer import build_tokenizer


def test_sentencepiece_tokenizer_matches_the_model_and_round_trips(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", spm_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    text = "def add(a, b):\n    return a + b  # é\n"
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.detokenize(tok.tokenize(text)) == text  # identity normalization keeps whitespace
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (600, sp.eos_id(), sp.bos_id(), sp.pad_id())
    assert len({tok.eod, tok.bos, tok.pad}) == 3
    assert [ids.tolist() for ids in tok.tokenize_batch([text, "x", ""])] == [sp.encode(text), sp.encode("x"), []]


def test_gpt_sentencepiece_type_is_the_same_tokenizer(spm_model):
    text = "for i in range(3): pass"
    assert build_tokenizer("GPTSentencePieceTokenizer", spm_model).tokenize(text) == \
        build_tokenizer("SentencePieceTokenizer", spm_model).tokenize(text)


def test_missing_or_unreadable_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.model: no such file"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "nope.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="garbage.model: not a readable SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(garbage))
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", None)


def test_null_tokenizer_reads_ids_and_uses_the_last_id_as_eod():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("3 14 15") == [3, 14, 15] and tok.detokenize([3, 14]) == "3 14"
    assert (tok.vocab_size, tok.eod) == (100, 99)
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")


def test_unknown_tokenizer_type_names_the_choices():
    with pytest.raises(ValueError, match="GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer"):
        build_tokenizer("BertWordPieceLowerCase")
