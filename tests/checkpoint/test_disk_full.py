"""A full disk or a read-only target: every writer exits non-zero with one line naming the path and the reason,
and leaves nothing under a final name and no temporary files. Each case writes into a tmpfs too small for its
output (skipped with the reason where no tmpfs can be mounted)."""
import os

import pytest

from tests.checkpoint.conftest import pretrain_in_one_process, run_tool
from tests.tmpfs import listing, remount_read_only, small_tmpfs

pytestmark = pytest.mark.slow

FULL = "No space left on device"
READ_ONLY = "Read-only file system"


def _refusal(result, tool, folder, reason):
    """The one error line, naming a path under `folder` and the reason; nothing left in `folder`."""
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), result.stderr[-3000:]
    assert f"{folder}/" in lines[0] and reason in lines[0], lines[0]
    return lines[0]


def test_train_tokenizer_on_a_full_disk(corpus, tmp_path):
    jsonl = os.path.join(os.path.dirname(corpus[0]), "corpus.jsonl")
    with small_tmpfs(tmp_path / "disk", 4096) as disk:  # one page: the 6 KB model does not fit
        result = run_tool("tools/train_tokenizer.py", "--input", jsonl, "--vocab-size", "400",
                          "--model-prefix", os.path.join(disk, "spm"), check=False)
        _refusal(result, "train_tokenizer.py", disk, FULL)
        assert listing(disk) == []


def test_preprocess_on_a_full_disk_and_a_read_only_folder(corpus, tmp_path):
    jsonl = os.path.join(os.path.dirname(corpus[0]), "corpus.jsonl")
    args = ["--input", jsonl, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpus[1],
            "--append-eod", "--workers", "1"]
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:  # the .bin is 2.7 MB
        result = run_tool("tools/preprocess_data.py", *args, "--output-prefix", os.path.join(disk, "corpus"),
                          check=False)
        _refusal(result, "preprocess_data.py", disk, FULL)
        assert listing(disk) == []
        remount_read_only(disk)
        result = run_tool("tools/preprocess_data.py", *args, "--output-prefix", os.path.join(disk, "corpus"),
                          check=False)
        _refusal(result, "preprocess_data.py", disk, READ_ONLY)


def test_merge_datasets_on_a_full_disk(corpus, tmp_path):
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        result = run_tool("tools/merge_datasets.py", "--input", corpus[0], "--output-prefix",
                          os.path.join(disk, "merged"), check=False)
        _refusal(result, "merge_datasets.py", disk, FULL)
        assert listing(disk) == []


@pytest.mark.parametrize("command", ["merge", "reshard", "export-hf"])
def test_convert_checkpoint_on_a_full_disk(zero1_run, tmp_path, command):
    with small_tmpfs(tmp_path / "disk", 64 * 1024) as disk:  # the outputs are 0.3 - 1 MB
        target = os.path.join(disk, "out")
        extra = {"merge": ["--output", target + ".pt"],
                 "reshard": ["--save", target, "--target-tensor-model-parallel-size", "1",
                             "--target-pipeline-model-parallel-size", "2", "--no-optimizer"],
                 "export-hf": ["--output", target]}[command]
        result = run_tool("tools/convert_checkpoint.py", command, "--load", zero1_run, *extra, check=False)
        _refusal(result, f"convert_checkpoint.py {command}", disk, FULL)
        assert listing(disk) == []


def test_training_saves_on_a_full_disk_and_into_a_read_only_folder(corpus, tmp_path):
    with small_tmpfs(tmp_path / "disk", 64 * 1024) as disk:  # room for the lock, not for a 1 MB checkpoint
        save = os.path.join(disk, "ckpt")
        result = pretrain_in_one_process(corpus, ["--train-iters", "2", "--eval-iters", "0", "--save", save])
        line = _refusal(result, "pretrain_gpt.py", disk, FULL)
        assert "the last complete checkpoint is kept" in line
        # no tmp-iter_*, no iter_*, no latest: only the lock and the run's metrics records
        assert listing(disk) == ["ckpt", "ckpt/.megatron_lite.lock", "ckpt/metrics", "ckpt/metrics/metrics.jsonl"]
        remount_read_only(disk)
        result = pretrain_in_one_process(corpus, ["--train-iters", "2", "--eval-iters", "0", "--save",
                                                  os.path.join(disk, "other")])
        _refusal(result, "pretrain_gpt.py", disk, READ_ONLY)


def test_an_async_save_on_a_full_disk_stops_the_run_at_its_end_with_one_line_and_no_temporary_folder(corpus,
                                                                                                    tmp_path):
    """The background writer fails; the run learns it where every rank waits (here, the end of the run)."""
    with small_tmpfs(tmp_path / "disk", 64 * 1024) as disk:
        save = os.path.join(disk, "ckpt")
        result = pretrain_in_one_process(corpus, ["--train-iters", "2", "--eval-iters", "0", "--save", save,
                                                  "--async-save"])
        line = _refusal(result, "pretrain_gpt.py", disk, FULL)
        assert "the last complete checkpoint is kept" in line
        assert listing(disk) == ["ckpt", "ckpt/.megatron_lite.lock", "ckpt/metrics", "ckpt/metrics/metrics.jsonl"]
