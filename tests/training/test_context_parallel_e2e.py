"""pretrain_gpt.py with --context-parallel-size 2 (its main on warm ranks, tests/entry_points.py): the data path (each CP rank's part of
the samples, EOD tokens out of the loss, DataLoader workers) trains and evaluates as one process does, and
--timing-breakdown shows the time in the all-to-alls."""
import json

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
from tests.entry_points import run_entry

pytestmark = pytest.mark.slow

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--vocab-size", "128", "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer", "--split", "90,10,0", "--train-iters", "3",
        "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--lr", "1e-3", "--seed", "3",
        "--eod-mask-loss", "--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("cp") / "docs")
    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(60):  # short documents: EOD (127) lands on both halves of most samples, unevenly
            writer.add_document(np.append(rng.randint(0, 127, size=rng.randint(5, 40)), 127))
    return prefix


def _records(folder):
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _run(data, tmp_path, name, nproc, extra):
    tb = tmp_path / name
    result = run_entry(["pretrain_gpt.py", *ARGS, "--data-path", data, "--tensorboard-dir", str(tb), *extra],
                       nproc, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, _records(tb)


def test_cp2_trains_and_evaluates_as_one_process_does(data, tmp_path):
    _, dense = _run(data, tmp_path, "cp1", 1, ["--num-workers", "0"])
    out, split = _run(data, tmp_path, "cp2", 2, ["--context-parallel-size", "2", "--num-workers", "1",
                                                 "--timing-breakdown"])
    assert "processes = TP 1 x CP 2 x PP 1 x DP 1" in out

    def losses(records, kind):
        return [r["loss"] for r in records if r["kind"] == kind]

    for kind in ("interval", "validation"):
        a, b = losses(dense, kind), losses(split, kind)
        assert len(a) == len(b) > 0, (kind, a, b)
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-5 * abs(x), (kind, a, b)
    timing = [r for r in split if r["kind"] == "stage_timing"]
    assert timing and timing[-1]["ms_per_iteration"]["stage0/cp-a2a"] > 0, timing
    assert "cp-a2a" in out
