"""The example scripts run end to end as a user runs them."""
import os
import subprocess

import pytest

from tests.harness import REPO_ROOT


def run_continue_from_hf(script, run_dir):
    """Run a continue_from_hf.sh as a user does without HF_MODEL (its random stand-in), 4 steps; its output."""
    env = dict(os.environ, CONTINUE_DIR=str(run_dir), CONTINUE_ITERS="4")
    env.pop("HF_MODEL", None)
    result = subprocess.run(["bash", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_continue_from_hf_imports_trains_at_tp2_pp2_exports_and_transformers_loads_it(tmp_path):
    out = run_continue_from_hf("examples/llama/continue_from_hf.sh", tmp_path / "run")
    assert "at TP=2, PP=2" in out and "iteration 0, a fresh optimizer" in out
    assert "tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model" in out  # recorded, then trained with
    assert "run completed: 4 of 4 iterations" in out
    assert "transformers loaded" in out and "continue_from_hf.sh done" in out
    assert sorted(os.listdir(tmp_path / "run" / "exported")) == ["config.json", "model.safetensors",
                                                                 "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.slow
def test_moe_continue_from_hf_imports_a_mixtral_at_pp2_ep2_trains_exports_and_transformers_gives_our_logits(tmp_path):
    out = run_continue_from_hf("examples/moe/continue_from_hf.sh", tmp_path / "run")
    assert "(MixtralForCausalLM," in out and "at TP=1, PP=2, EP=2" in out
    assert "tokenizer: --tokenizer-type SentencePieceTokenizer --tokenizer-model" in out  # recorded, then trained with
    assert "4 processes = TP 1 x PP 2 x DP 2" in out and "iteration 0, a fresh optimizer" in out
    assert "run completed: 4 of 4 iterations" in out
    assert "as MixtralForCausalLM" in out and "logits equal ours" in out and "continue_from_hf.sh done" in out
    assert sorted(os.listdir(tmp_path / "run" / "exported")) == ["config.json", "model.safetensors",
                                                                 "tokenizer.model"]
