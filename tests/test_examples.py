"""The example scripts run end to end as a user runs them."""
import os
import subprocess

import pytest

from tests.harness import REPO_ROOT


@pytest.mark.slow
def test_continue_from_hf_imports_trains_at_tp2_pp2_exports_and_transformers_loads_it(tmp_path):
    env = dict(os.environ, CONTINUE_DIR=str(tmp_path / "run"), CONTINUE_ITERS="4")
    env.pop("HF_MODEL", None)
    result = subprocess.run(["bash", "examples/llama/continue_from_hf.sh"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "at TP=2, PP=2" in out and "iteration 0, a fresh optimizer" in out
    assert "tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model" in out  # recorded, then trained with
    assert "run completed: 4 of 4 iterations" in out
    assert "transformers loaded" in out and "continue_from_hf.sh done" in out
    assert sorted(os.listdir(tmp_path / "run" / "exported")) == ["config.json", "model.safetensors",
                                                                 "tokenizer.json", "tokenizer_config.json"]
