"""A truncated checkpoint file under pretrain_gpt.py --load and tools/evaluate.py at the checkpoint's own layout
(4 ranks): one line naming the file from rank 0, every rank stops (no hang, no gloo 'Connection closed by peer'),
exit 2. Only one rank reads the file: the ranks agree on the problem before any of them loads."""
import os
import re

import pytest

from tests.checkpoint.conftest import MODEL, copy_checkpoint, data_args, layout
from tests.harness import run_launcher

pytestmark = pytest.mark.slow

BAD = "layer_04-model_01-model_states.pt"  # stage 1, TP rank 1: global rank 3 alone reads it


def _truncated(run22, tmp_path):
    ckpt = copy_checkpoint(run22["ckpt"], tmp_path / "ckpt")
    path = os.path.join(ckpt, "iter_0000004", BAD)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return ckpt


def _one_refusal(result, prefix):
    # Every rank exits 2 by itself; torchrun may stop the slower ones first (SIGTERM, exit code -15).
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
    assert result.returncode != 0 and "2" in codes and set(codes) <= {"2", "-15"}, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prefix}: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    # torchrun reports the failed workers with a traceback of its own; ours add none
    assert "megatron_lite/" not in result.stderr and "Connection closed by peer" not in result.stderr
    return lines[0]


def test_pretrain_load_of_a_truncated_layer_file_stops_every_rank_with_one_line(run22, tmp_path):
    ckpt = _truncated(run22, tmp_path)
    result = run_launcher(["pretrain_gpt.py", *MODEL, *data_args(run22["corpus"]), *layout(2, 2),
                           "--train-iters", "6", "--load", ckpt, "--override-opt-param-scheduler"], nproc=4,
                          timeout=300)
    line = _one_refusal(result, "pretrain_gpt.py")
    assert BAD in line and "truncated" in line, line


def test_evaluate_at_the_checkpoints_layout_of_a_truncated_layer_file_stops_every_rank_with_one_line(run22, tmp_path):
    ckpt = _truncated(run22, tmp_path)
    result = run_launcher(["tools/evaluate.py", "--load", ckpt], nproc=4, timeout=300)
    line = _one_refusal(result, "evaluate.py")
    assert BAD in line and "truncated" in line, line
