import gzip
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece

from megatron_lite.data.indexed_dataset import IndexedDataset
from tests.data.conftest import REPO_ROOT, run_tool


def corpus_texts(corpus, n):
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def mixed_input(corpus, tmp_path_factory):
    """Good documents with every kind of bad line between them; returns (path, good texts, bad line numbers)."""
    texts = corpus_texts(corpus, 6)
    lines = [
        json.dumps({"text": texts[0]}).encode(),
        b'{"text": "unterminated',                           # 2: invalid JSON
        json.dumps({"text": texts[1], "id": 7}).encode(),
        json.dumps({"body": "no text key"}).encode(),         # 4: missing key
        json.dumps({"text": ""}).encode(),                    # an empty document: kept, no tokens
        json.dumps({"text": 123}).encode(),                   # 6: not a string
        b'{"text": "caf\xe9"}',                               # 7: Latin-1, not UTF-8
        json.dumps({"text": texts[2]}, ensure_ascii=False).encode(),
        b"",                                                  # 9: blank line
        json.dumps({"text": "a\ud800b"}).encode(),            # 10: lone surrogate escape
        json.dumps(["a list"]).encode(),                      # 11: not an object
    ] + [json.dumps({"text": t}).encode() for t in texts[3:]]
    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    good = [texts[0], texts[1], "", texts[2]] + texts[3:]
    return path, good, [2, 4, 6, 7, 9, 10, 11]


def preprocess(input_path, prefix, spm_model, *extra, check=True):
    return run_tool("preprocess_data.py", "--input", input_path, "--output-prefix", prefix,
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm_model,
                    "--append-eod", *extra, check=check)


def test_tokens_equal_direct_sentencepiece_encode_plus_eod_and_bad_lines_are_counted(mixed_input, spm_model, tmp_path):
    path, good, bad_numbers = mixed_input
    proc = preprocess(path, tmp_path / "out", spm_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    expected = [sp.encode(t) + [sp.eos_id()] for t in good if t]
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.num_documents == len(good)
    assert f"{len(bad_numbers)} bad lines skipped" in proc.stdout
    reported = [int(line.split(":")[1]) for line in proc.stderr.splitlines() if line.startswith("skipping")]
    assert reported == bad_numbers[:5]
    assert "invalid JSON" in proc.stderr and "no key 'text'" in proc.stderr and "invalid UTF-8" in proc.stderr


def test_output_is_byte_identical_to_the_megatron_layout_built_by_hand(corpus, spm_model, tmp_path):
    texts = corpus_texts(corpus, 5) + [""]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    preprocess(path, tmp_path / "out", spm_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    docs = [sp.encode(t) + [sp.eos_id()] if t else [] for t in texts]
    seqs = [d for d in docs if d]
    pointers = np.concatenate([[0], np.cumsum([2 * len(d) for d in seqs])[:-1]])
    doc_index = np.concatenate([[0], np.cumsum([1 if d else 0 for d in docs])])
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(seqs), len(doc_index))
           + np.array([len(d) for d in seqs], "<i4").tobytes() + pointers.astype("<i8").tobytes()
           + doc_index.astype("<i8").tobytes())
    assert (tmp_path / "out_text_document.idx").read_bytes() == idx
    assert (tmp_path / "out_text_document.bin").read_bytes() == np.array(sum(seqs, []), "<u2").tobytes()


def test_one_and_two_workers_and_gzip_input_write_identical_files(corpus, spm_model, tmp_path):
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    preprocess(corpus, tmp_path / "w1", spm_model, "--workers", 1)
    # Small chunks so that the two workers interleave many chunks whose order must be restored.
    preprocess(corpus, tmp_path / "w2", spm_model, "--workers", 2, "--chunk-documents", 3)
    preprocess(gz, tmp_path / "gz", spm_model, "--workers", 2, "--chunk-documents", 5)
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert (tmp_path / f"w2_text_document{suffix}").read_bytes() == one
        assert (tmp_path / f"gz_text_document{suffix}").read_bytes() == one


def test_bad_lines_keep_their_numbers_when_the_input_is_cut_into_many_blocks(mixed_input, spm_model, tmp_path):
    path, good, bad_numbers = mixed_input
    whole = preprocess(path, tmp_path / "whole", spm_model)
    # Blocks of 2 lines, tokenized by 2 workers: the reader numbers each block's lines after the ones before it.
    cut = preprocess(path, tmp_path / "cut", spm_model, "--workers", 2, "--chunk-documents", 2)
    assert [line for line in cut.stderr.splitlines() if line.startswith("skipping")] == \
        [line for line in whole.stderr.splitlines() if line.startswith("skipping")]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"cut_text_document{suffix}").read_bytes() == \
            (tmp_path / f"whole_text_document{suffix}").read_bytes()


def test_lines_end_at_cr_lf_and_bare_cr_as_in_the_text_mode_megatron_lm_reads_with(corpus, spm_model, tmp_path):
    texts = corpus_texts(corpus, 7)
    endings = [b"\r\n", b"\r", b"\n", b"\r\n", b"\r", b"\n", b""]  # the last line has no ending
    path = tmp_path / "mixed_endings.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": t}).encode() + end for t, end in zip(texts, endings)))
    with open(path, encoding="utf-8") as f:  # universal newlines, as Megatron-LM's tools/preprocess_data.py
        expected_texts = [json.loads(line)["text"] for line in f]
    assert expected_texts == texts
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    for workers, chunk in ((1, 64), (2, 2)):
        proc = preprocess(path, tmp_path / f"w{workers}", spm_model, "--workers", workers, "--chunk-documents", chunk)
        assert "0 bad lines skipped" in proc.stdout
        ds = IndexedDataset(str(tmp_path / f"w{workers}_text_document"))
        assert [ds[i].tolist() for i in range(len(ds))] == [sp.encode(t) + [sp.eos_id()] for t in texts]


def test_strict_stops_at_the_first_bad_line_with_status_1_and_writes_nothing(mixed_input, spm_model, tmp_path):
    path, _, bad_numbers = mixed_input
    proc = preprocess(path, tmp_path / "out", spm_model, "--strict", check=False)
    assert proc.returncode == 1
    assert f"mixed.jsonl:{bad_numbers[0]}: invalid JSON" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_input_without_documents_exits_1_and_missing_model_exits_2(spm_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    proc = preprocess(bad, tmp_path / "out", spm_model, check=False)
    assert proc.returncode == 1 and "no line held a document" in proc.stderr
    proc = preprocess(bad, tmp_path / "out", tmp_path / "missing.model", check=False)
    assert proc.returncode == 2 and "missing.model: no such file" in proc.stderr
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_preprocess_tool_imports_neither_torch_nor_deepspeed():
    code = ("import runpy, sys; runpy.run_path('tools/preprocess_data.py', run_name='not_main'); "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
