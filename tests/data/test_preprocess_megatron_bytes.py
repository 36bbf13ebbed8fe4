"""preprocess_data.py with GPT-2 BPE and Hugging Face tokenizers writes the bytes Megatron-LM's own tool writes.

The hashes below are of the .bin/.idx that NVIDIA/Megatron-LM's tools/preprocess_data.py wrote at commit
4ff7686c144fcd3f6ac130e5a97f86a0b8aa4dd5 (Feb 2026, the last with its --legacy-tokenizer system, whose
GPT2BPETokenizer reads vocab.json + merges.txt without the Hugging Face hub), run on CPU through
tests/data/megatron_lm_tool.py, from tests/data/bpe_files.py's corpus and files, with --append-eod. For
HuggingFaceTokenizer its legacy and its new tokenizer system (with --tokenizer-hf-use-fast
--tokenizer-hf-include-special-tokens, today's defaults) wrote the same bytes. Set MEGATRON_LM to a checkout
of that commit to run Megatron-LM's tool again here and compare the files themselves.
"""
import hashlib
import os
import subprocess
import sys

import pytest

from tests.data.conftest import REPO_ROOT, run_tool

INPUTS = {"corpus.jsonl": "8962dae8ed3990c6aa2a3bbaf0238145e8aa4c49e3f27f4a594ee4e23a5664ba",
          "vocab.json": "67fcd778657383059d1e90162157456372076427d9e3d3639ce51121e00e85f9",
          "merges.txt": "1855e41b98f85bf8cc50e9de3003f2fbf1a41b80e6296f4a9cd5e335acdf3b5c"}
MEGATRON_LM_OUTPUT = {
    "GPT2BPETokenizer": ("15a694c5c1d68b76f5c9ab09dc926817bd1e95a57150aa964298c8d01573bc8e",
                         "814ffa10fe69c463ad3cc529f90af7d03f63cb8be70a9c0a2e275bd70d043fbf"),
    "HuggingFaceTokenizer": ("dfa6337641f64736c3f474d3504fe4eadd2777dad1dde6706cc577a510c6ee37",
                             "6df5497488c2a2b3862e0c9d7256c77087ccea00b75cecdff41496cce8dd2e23"),
}


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def tokenizer_flags(kind, bpe_files):
    if kind == "GPT2BPETokenizer":
        return ["--tokenizer-type", kind, "--vocab-file", bpe_files["vocab_file"], "--merge-file",
                bpe_files["merge_file"]]
    return ["--tokenizer-type", kind, "--tokenizer-model", bpe_files["hf"]]


def test_the_corpus_and_bpe_files_are_those_the_megatron_lm_hashes_were_made_from(bpe_files):
    files = {"corpus.jsonl": bpe_files["corpus"], "vocab.json": bpe_files["vocab_file"],
             "merges.txt": bpe_files["merge_file"]}
    assert {name: sha256(path) for name, path in files.items()} == INPUTS, \
        "tests/data/bpe_files.py changed: rerun Megatron-LM's tool (MEGATRON_LM=...) and record its output again"


@pytest.mark.parametrize("kind, workers", [("GPT2BPETokenizer", 1), ("HuggingFaceTokenizer", 2)])
def test_preprocess_output_has_the_sha256_of_megatron_lm_output(kind, workers, bpe_files, tmp_path):
    run_tool("preprocess_data.py", "--input", bpe_files["corpus"], "--output-prefix", tmp_path / "out",
             *tokenizer_flags(kind, bpe_files), "--append-eod", "--workers", workers)
    written = tuple(sha256(tmp_path / f"out_text_document{suffix}") for suffix in (".bin", ".idx"))
    assert written == MEGATRON_LM_OUTPUT[kind]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEGATRON_LM"), reason="MEGATRON_LM (a Megatron-LM checkout) is not set")
@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_preprocess_output_equals_megatron_lm_tool_run_here(kind, bpe_files, tmp_path):
    megatron = os.environ["MEGATRON_LM"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    theirs = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tests", "data", "megatron_lm_tool.py"), megatron,
         os.path.join(megatron, "tools", "preprocess_data.py"), "--input", bpe_files["corpus"], "--output-prefix",
         str(tmp_path / "theirs"), *tokenizer_flags(kind, bpe_files), "--append-eod", "--workers", "1",
         "--legacy-tokenizer"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    run_tool("preprocess_data.py", "--input", bpe_files["corpus"], "--output-prefix", tmp_path / "ours",
             *tokenizer_flags(kind, bpe_files), "--append-eod")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{suffix}").read_bytes() == \
            (tmp_path / f"theirs_text_document{suffix}").read_bytes()
