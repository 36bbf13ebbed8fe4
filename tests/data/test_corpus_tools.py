import json
import os

import pytest
import sentencepiece

from tests.data.conftest import REPO_ROOT, run_tool


def test_make_corpus_is_deterministic_and_respects_both_caps(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_tool("make_corpus.py", "--output", first, "--max-docs", 12, "--max-bytes", 150_000)
    proc = run_tool("make_corpus.py", "--output", second, "--max-docs", 12, "--max-bytes", 150_000)
    assert first.read_bytes() == second.read_bytes()
    docs = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    assert 0 < len(docs) <= 12 and sum(len(d["text"].encode()) for d in docs) <= 150_000
    assert all(d["path"].endswith(".py") and d["text"] for d in docs)
    assert proc.stdout.startswith(f"wrote {len(docs)} documents")
    run_tool("make_corpus.py", "--output", first, "--max-docs", 3, "--overwrite")
    assert len(first.read_text(encoding="utf-8").splitlines()) == 3


def test_train_tokenizer_honours_model_type_vocab_size_and_byte_fallback(corpus, tmp_path):
    proc = run_tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "uni",
                    "--model-type", "unigram", "--vocab-size", 400, "--no-byte-fallback", "--num-threads", 1)
    assert "trained unigram vocab 400" in proc.stdout
    uni = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "uni.model"))
    assert uni.vocab_size() == 400 and "<0x41>" not in {uni.id_to_piece(i) for i in range(400)}
    run_tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "bpe", "--vocab-size", 400,
             "--num-threads", 1)
    bpe = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "bpe.model"))
    assert bpe.encode("\u4e2d")[-1] == bpe.piece_to_id("<0xAD>")  # an unseen character becomes UTF-8 bytes
    assert (bpe.unk_id(), bpe.bos_id(), bpe.eos_id(), bpe.pad_id()) == (0, 1, 2, 3)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_the_vocab_file_the_tool_writes_is_byte_for_byte_what_sentencepiece_writes(corpus, tmp_path, model_type):
    """The tool takes the model from SentencePiece in memory and writes both files itself (so that a full disk
    is an error, not a truncated model); its .vocab must be what SentencePiece writes for the same model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tokenizer", os.path.join(REPO_ROOT, "tools",
                                                                                  "train_tokenizer.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "ref"),
                                             vocab_size=600, model_type=model_type, byte_fallback=True,
                                             num_threads=1, minloglevel=2)
    model = (tmp_path / "ref.model").read_bytes()
    assert tool.vocab_text(model).encode("utf-8") == (tmp_path / "ref.vocab").read_bytes()
