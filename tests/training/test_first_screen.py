"""What a user sees first: our layout line, the stage table, the first iterations; no DeepSpeed start-up noise.
The same short run checks the metrics records written next to the TensorBoard events."""
import json
import re
import subprocess

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
from tests.harness import start_launcher

NOISE = ("[WARNING]", "[INFO]", "DeepSpeed", "SEED_LAYERS", "Using topology", "real_accelerator")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_screen")
    prefix = str(root / "null_text_document")
    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(100):
            writer.add_document(np.append(rng.randint(0, 127, size=rng.randint(20, 80)), 127))
    argv = ["pretrain_gpt.py", "--pipeline-model-parallel-size", "2", "--num-layers", "3", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "32", "--vocab-size", "128",
            "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split", "90,10,0", "--num-workers", "0",
            "--train-iters", "3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--tensorboard-dir", str(root / "tb")]
    proc = start_launcher(argv, nproc=2, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out.splitlines(), root / "tb" / "metrics.jsonl"


def test_the_first_lines_are_ours_and_deepspeeds_start_up_lines_are_gone(short_run):
    lines, _ = short_run
    # Validation's warnings stay (stderr, rank 0), then the layout line, the stage table, the first iteration.
    assert lines[0].startswith("warning: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2")
    assert lines[1].startswith("megatron_lite: 2 processes = TP 1 x PP 2 x DP 1 (gloo, cpu) | ZeRO 0 | fp32 | "
                               "optimizer AdamW | global batch 4 = micro 1 x 4 accumulation x DP 1 | GPT 3 layers, hidden 32")
    assert lines[2] == "pipeline stages (cost):"
    assert lines[6].startswith("predicted pipeline efficiency") and lines[7].startswith("iteration       1/3 |")
    assert not [line for line in lines if any(noise in line for noise in NOISE)]
    assert lines[-1].startswith("run completed: 3 of 3 iterations in ") and "metrics in " in lines[-1]
    assert not re.search(r"iteration\s+\d+/\d+ .*?\| loss", lines[-1])  # not parsed as a log line by scripts


def test_metrics_records_follow_the_run(short_run):
    _, path = short_run
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start", "interval", "stage_memory", "interval", "interval",
                                            "validation", "summary"]
    start, first = records[0], records[1]
    assert start["config"]["parallel"]["pipeline_model_parallel_size"] == 2 and start["iteration"] == 0
    assert first["iteration"] == 1 and first["tokens_per_s"] > 0 and "loss" in first and "tflops_per_rank" in first
    assert [s["stage"] for s in records[2]["stages"]] == [0, 1]
    assert records[5]["iteration"] == 3 and records[5]["loss"] > 0
    assert records[-1]["status"] == "completed" and records[-1]["last_loss"] == records[4]["loss"]
