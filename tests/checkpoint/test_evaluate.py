"""evaluate.py: the perplexity of a checkpoint is exp of the validation loss training logged for it."""
import math
import re

import pytest

from tests.entry_points import run_entry

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp, pp", [(1, 2)])
def test_evaluate_perplexity_equals_exp_of_the_logged_validation_loss(run22, tp, pp):
    # TP 2 x PP 2 training, evaluated under another layout (resharded on the fly) on 2 processes
    prefix, _ = run22["corpus"]
    result = run_entry(["tools/evaluate.py", "--load", run22["ckpt"], "--data-path", prefix, "--split", "90,10,0",
                           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)],
                          nproc=tp * pp, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"at iteration 4 on the valid split: loss (\S+) \| perplexity (\S+)", result.stdout)
    assert match, result.stdout[-2000:]
    loss, perplexity = float(match.group(1)), float(match.group(2))
    logged = run22["valid"][4]
    assert perplexity == pytest.approx(math.exp(logged), rel=1e-5)
    assert loss == pytest.approx(logged, rel=1e-5)
    assert f"TP={tp}, PP={pp}" in result.stdout



def test_a_llama_block_trained_at_tp2_evaluates_at_tp4_with_shared_query_groups_to_its_logged_loss(llama_run):
    prefix, _ = llama_run["corpus"]
    result = run_entry(["tools/evaluate.py", "--load", llama_run["ckpt"], "--data-path", prefix,
                           "--split", "90,10,0", "--tensor-model-parallel-size", "4"], nproc=4, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"at iteration 2 on the valid split: loss (\S+)", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) == pytest.approx(llama_run["valid"][2], rel=1e-5)
