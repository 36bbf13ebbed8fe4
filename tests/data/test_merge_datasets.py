import json
import os
import shutil

import pytest
import sentencepiece

from tests.data.corpus_mix import merge_datasets, preprocess, preprocess_shards, write_corpus_mix

NUM_SHARDS = 3


@pytest.fixture(scope="module")
def shards(corpus, spm_model, tmp_path_factory):
    """A finished 3-shard run, copied afresh by each test that damages it."""
    root = tmp_path_factory.mktemp("merge")
    input_glob, _ = write_corpus_mix(corpus, root / "corpus")
    preprocess_shards(input_glob, root / "shards" / "corpus", spm_model, NUM_SHARDS)
    return input_glob, root / "shards"


@pytest.fixture
def damaged(shards, tmp_path):
    folder = tmp_path / "shards"
    shutil.copytree(shards[1], folder)
    return folder


def shard_file(folder, index, suffix):
    return folder / f"corpus_text_document.shard-{index:05d}-of-{NUM_SHARDS:05d}{suffix}"


def refuse(folder, tmp_path, capsys, *inputs):
    """Runs the merge, expects exit 2, nothing at the output prefix, and returns the one-line message."""
    capsys.readouterr()
    status = merge_datasets.main(["--input", *map(str, inputs or [folder]), "--output-prefix",
                                  str(tmp_path / "out" / "merged")])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert not (tmp_path / "out").exists()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("merge_datasets.py: error: ")
    return lines[0]


def test_merge_refuses_a_missing_shard_naming_it(damaged, tmp_path, capsys):
    for suffix in (".bin", ".idx", ".json"):
        os.remove(shard_file(damaged, 1, suffix))
    message = refuse(damaged, tmp_path, capsys)
    assert "1 of 3 shards missing" in message and shard_file(damaged, 1, ".{bin,idx,json}").name in message


def test_merge_refuses_a_shard_without_its_index_file(damaged, tmp_path, capsys):
    os.remove(shard_file(damaged, 2, ".idx"))
    message = refuse(damaged, tmp_path, capsys)
    assert f"{shard_file(damaged, 2, '.idx')}: missing" in message


def test_merge_refuses_an_unfinished_shard_without_its_sidecar(damaged, tmp_path, capsys):
    os.remove(shard_file(damaged, 0, ".json"))
    message = refuse(damaged, tmp_path, capsys)
    assert f"{shard_file(damaged, 0, '.json')}: missing; the output is incomplete" in message


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_merge_refuses_a_truncated_shard_naming_the_file(damaged, tmp_path, capsys, suffix):
    path = shard_file(damaged, 1, suffix)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 6])
    message = refuse(damaged, tmp_path, capsys)
    assert f"{path}: {len(data) - 6} bytes" in message and "truncated" in message


def test_merge_refuses_a_shard_of_another_tokenizer(shards, damaged, tmp_path, capsys, corpus):
    prefix = tmp_path / "other"
    sentencepiece.SentencePieceTrainer.train(input=str(corpus_text_file(corpus, tmp_path)), model_prefix=str(prefix),
                                             vocab_size=300, num_threads=1, minloglevel=2)
    for suffix in (".bin", ".idx", ".json"):
        os.remove(shard_file(damaged, 2, suffix))
    assert preprocess(shards[0], damaged / "corpus", f"{prefix}.model", "--num-shards", NUM_SHARDS,
                      "--shard-index", 2) == 0
    message = refuse(damaged, tmp_path, capsys)
    assert str(shard_file(damaged, 2, ".json")) in message and "tokenizer" in message
    assert "vocab_size 300" in message and "vocab_size 600" in message


def test_merge_refuses_a_shard_of_another_dtype(damaged, tmp_path, capsys):
    # A vocabulary of 70,000 ids is stored as int32; the other shards are uint16.
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": f"{i} {i + 1} 69999"}) + "\n" for i in range(20)))
    for suffix in (".bin", ".idx", ".json"):
        os.remove(shard_file(damaged, 0, suffix))
    from tests.data.corpus_mix import preprocess_data
    assert preprocess_data.main(["--input", str(numbers), "--output-prefix", str(damaged / "corpus"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000",
                                 "--num-shards", str(NUM_SHARDS), "--shard-index", "0"]) == 0
    message = refuse(damaged, tmp_path, capsys)
    assert str(shard_file(damaged, 1, ".json")) in message and "dtype 'uint16' differs from 'int32'" in message


def test_merge_refuses_shards_of_two_runs_and_leaves_an_existing_output_alone(shards, damaged, tmp_path, capsys,
                                                                            spm_model):
    other = tmp_path / "other"
    preprocess_shards(shards[0], other / "corpus", spm_model, 2)
    out = tmp_path / "out"
    message = refuse(damaged, tmp_path, capsys, shard_file(damaged, 0, ".idx"),
                     other / "corpus_text_document.shard-00001-of-00002.idx")
    assert "shard count 2 differs from 3" in message
    out.mkdir()
    (out / "merged.bin").write_bytes(b"kept")
    assert merge_datasets.main(["--input", str(damaged), str(other), "--output-prefix", str(out / "merged")]) == 2
    assert "merge_datasets.py: error:" in capsys.readouterr().err
    assert os.listdir(out) == ["merged.bin"] and (out / "merged.bin").read_bytes() == b"kept"


def corpus_text_file(corpus, tmp_path):
    path = tmp_path / "corpus.txt"
    # A few pages of text: enough for a 300-entry vocabulary, quick to train.
    path.write_text("\n".join(json.loads(line)["text"] for line in open(corpus, encoding="utf-8"))[:30_000])
    return path
