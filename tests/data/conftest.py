"""Shared data fixtures: a small real corpus (stdlib sources) and a tiny SentencePiece model, built once."""
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(name, *args, check=True):
    """Run tools/<name>.py in a fresh interpreter (as a user would); returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", name), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    run_tool("make_corpus.py", "--output", path, "--max-docs", 40, "--max-bytes", 400_000)
    return path


@pytest.fixture(scope="session")
def spm_model(corpus, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    run_tool("train_tokenizer.py", "--input", corpus, "--model-prefix", prefix, "--vocab-size", 600,
             "--num-threads", 1)
    return f"{prefix}.model"


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory):
    """Corpus, GPT-2 vocab.json + merges.txt and a Hugging Face folder of the same BPE (tests/data/bpe_files.py)."""
    from tests.data.bpe_files import corpus_texts, write_corpus, write_gpt2_files, write_hf_folder

    root = tmp_path_factory.mktemp("bpe")
    texts = corpus_texts()
    vocab_file, merge_file = write_gpt2_files(root / "gpt2", texts)
    return {"texts": texts, "corpus": write_corpus(root / "corpus.jsonl", texts), "vocab_file": vocab_file,
            "merge_file": merge_file, "hf": write_hf_folder(root / "hf", vocab_file, merge_file)}
