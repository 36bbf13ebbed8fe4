"""examples/slurm/submit_preprocess.sh on the real two-node Slurm: an array job of shards, the merge as
a job that depends on it, and the same bytes as one run over the whole input."""
import gzip
import os
import re
import subprocess
import sys

import pytest
import zstandard

from tests.harness import REPO_ROOT
from tests.slurm.cluster import Job

pytestmark = pytest.mark.slow


def mixed_inputs(corpus, folder):  # noqa: F811
    """The e2e corpus's documents as a plain, a gzip and a zstd JSONL file."""
    jsonl = os.path.join(os.path.dirname(corpus[0]), "corpus.jsonl")
    lines = open(jsonl, "rb").read().splitlines(keepends=True)
    third = len(lines) // 3
    os.makedirs(folder)
    open(os.path.join(folder, "a.jsonl"), "wb").write(b"".join(lines[:third]))
    with gzip.open(os.path.join(folder, "b.jsonl.gz"), "wb") as f:
        f.write(b"".join(lines[third:2 * third]))
    open(os.path.join(folder, "c.jsonl.zst"), "wb").write(zstandard.ZstdCompressor().compress(b"".join(lines[2 * third:])))
    return os.path.join(folder, "*.jsonl*")


def test_array_shards_then_dependent_merge_give_the_bytes_of_one_run(slurm_cluster, corpus, tmp_path):  # noqa: F811
    pattern = mixed_inputs(corpus, str(tmp_path / "in"))
    tokenizer = corpus[1]
    single = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", pattern, "--output-prefix",
                             str(tmp_path / "single"), "--tokenizer-type", "SentencePieceTokenizer",
                             "--tokenizer-model", tokenizer, "--append-eod", "--workers", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr

    env = slurm_cluster.env(NUM_SHARDS="3", INPUT=pattern, OUTPUT_DIR=str(tmp_path / "shards"), NAME="corpus",
                            TOKENIZER_MODEL=tokenizer, REPO=REPO_ROOT, OUTPUT_PREFIX=str(tmp_path / "merged"),
                            SBATCH_ARGS=f"--cpus-per-task 1 --output {tmp_path}/%x-%A_%a.out")
    submitted = subprocess.run(["bash", "examples/slurm/submit_preprocess.sh"], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    _, merge_id = re.search(r"array job (\d+) \(3 shards\) and merge job (\d+)", submitted.stdout).groups()
    info = slurm_cluster.wait(Job(merge_id, str(tmp_path / f"merge-{merge_id}.out")), timeout=300)
    logs = "\n".join(open(p).read() for p in sorted(tmp_path.glob("*.out")))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs[-4000:]
    assert len(list((tmp_path / "shards").glob("corpus_text_document.shard-*-of-00003.bin"))) == 3
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"single_text_document{suffix}").read_bytes()
