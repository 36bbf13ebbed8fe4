"""Checkpoints shared by the checkpoint-tool tests: made once per test run (tests/artefacts.py, shared by
every pytest-xdist worker) by the real training entry point on warm ranks (tests/entry_points.py).

- `run22`: TP 2 x PP 2 (4 processes), 4 layers, dropout 0, fp32, 4 steps, checkpoints at 2 and 4,
  validation at 2 and 4, every loss in TensorBoard (full precision).
- `rope_run`: one process, rotary positions, 1 step (a model GPT-2 cannot represent).
- `llama_run`: TP 2 (2 processes), the Llama-family block with 2 query groups, 2 steps, saved at 2.
"""
import shutil

import pytest

from tests.artefacts import built_once
from tests.entry_points import run_entry, run_script

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
         "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "2", "--num-workers", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
         # vocabulary 400 pads to 512 at TP 1 and TP 2 alike, so resharding between them keeps the padding
         "--make-vocab-size-divisible-by", "128"]

def run_tool(*args, check=True, timeout=300):
    """A script of the checkout with these arguments (tests/entry_points.py's run_script: warm for the scripts
    that import torch): its CompletedProcess (exit code, stdout, stderr)."""
    result = run_script(*args, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def data_args(corpus):
    prefix, model = corpus
    return ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
            "--split", "90,10,0"]


def pretrain(corpus, nproc, args, timeout=400):
    """pretrain_gpt.py on nproc warm ranks (tests/entry_points.py); it must succeed."""
    result = run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *args], nproc, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def run22(corpus, tmp_path_factory):
    root = built_once(tmp_path_factory, "run22", lambda root: pretrain(
        corpus, 4, layout(2, 2) + ["--train-iters", "4", "--save", str(root / "ckpt"), "--save-interval", "2",
                                   "--tensorboard-dir", str(root / "tb")]))
    return {"ckpt": str(root / "ckpt"), "tb": str(root / "tb"), "losses": scalars(root / "tb", "train/loss"),
            "valid": scalars(root / "tb", "valid/loss"), "corpus": corpus}


@pytest.fixture(scope="session")
def rope_run(corpus, tmp_path_factory):
    root = built_once(tmp_path_factory, "rope_run", lambda root: pretrain(
        corpus, 1, layout(1, 1) + ["--position-embedding-type", "rope", "--train-iters", "1", "--eval-iters", "0",
                                   "--save", str(root / "ckpt")]))
    return str(root / "ckpt")


LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
               "--num-attention-heads", "4", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--position-embedding-type", "rope", "--use-rope-scaling", "--ffn-hidden-size", "64"]


@pytest.fixture(scope="session")
def llama_run(corpus, tmp_path_factory):
    root = built_once(tmp_path_factory, "llama_run", lambda root: pretrain(
        corpus, 2, layout(2, 1) + LLAMA_FLAGS + ["--train-iters", "2", "--save", str(root / "ckpt"),
                                                 "--tensorboard-dir", str(root / "tb")]))
    return {"ckpt": str(root / "ckpt"), "valid": scalars(root / "tb", "valid/loss"), "corpus": corpus}


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def edited_copy(src, dst, section, **fields):
    """A copy of the checkpoint whose recorded config has these fields of `section` changed (as a user's edit
    would)."""
    import json

    from megatron_lite.checkpoint.format import METADATA, read_latest

    copy_checkpoint(src, dst)
    path = f"{dst}/{read_latest(str(dst))}/{METADATA}"
    with open(path) as f:
        metadata = json.load(f)
    metadata["config"][section].update(fields)
    with open(path, "w") as f:
        json.dump(metadata, f)
    return str(dst)


@pytest.fixture(scope="session")
def zero1_run(corpus, tmp_path_factory):
    """One process, ZeRO 1 (so the checkpoint has a ZeRO partition file besides the layer, model-states and
    random-generator files), 2 steps, saved at 2."""
    root = built_once(tmp_path_factory, "zero1_run", lambda root: pretrain(
        corpus, 1, layout(1, 1) + ["--zero-stage", "1", "--train-iters", "2", "--eval-iters", "1",
                                   "--save", str(root / "ckpt")]))
    return str(root / "ckpt")


def pretrain_in_one_process(corpus, args, timeout=300):
    """pretrain_gpt.py on one warm rank: a world of one, no launcher (its CompletedProcess, not checked)."""
    return run_tool("pretrain_gpt.py", *MODEL, *data_args(corpus), *args, check=False, timeout=timeout)


def error_line(result, code=2):
    """The one error line a refused command prints (and no traceback)."""
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]
