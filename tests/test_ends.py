"""A model too large for this machine is refused from the parameter arithmetic before anything is allocated
(pretrain_gpt.py's main in this process: the refusal comes before torch is imported or a process group made).

The ends of generate.py's ranges: a temperature so small that logits / temperature overflows samples the most
likely token (the limit of sampling as the temperature goes to 0) instead of a torch.multinomial traceback, and a
text --prompt for a NullTokenizer model is one line naming --prompt and the ids it takes, not int()'s message.

Called in this process on the functions generate.py calls (a checkpoint is not needed for either).
"""
import importlib.util
import os

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.data.tokenizer import NullTokenizer
from megatron_lite.inference.prompt import prompt_ids
from megatron_lite.inference.sampling import sample
from megatron_lite.validation.machine_memory import GIB, weights_problem
from tests import tool_calls
from tests.data.corpus_mix import load_tool
from tests.harness import REPO_ROOT
from tests.tool_calls import snapshot

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size",
         "128", "--tokenizer-type", "NullTokenizer", "--train-iters", "2", "--split", "90,10,0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    assert tool_calls.call(load_tool("synthetic_data").main, ["--output-dir", folder, "--vocab-size", "128",
                                                              "--num-tokens", "20000"])[0] == 0
    return MODEL + ["--data-path", str(folder / "data_text_document")]


def _pretrain_main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(REPO_ROOT, "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("extra,flag,gib", [
    (["--kv-channels", "99999999"], "--kv-channels 99999999", "771.9 GiB"),
    (["--num-experts", "2147483647", "--moe-router-topk", "2"], "--num-experts 2147483647", "530,448.0 GiB")],
    ids=["kv-channels", "num-experts"])
def test_a_model_whose_weights_exceed_this_machine_is_refused_from_the_estimate(base, extra, flag, gib, tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("megatron_lite.validation.machine_memory.gpu_memory_bytes", lambda: None)
    line = tool_calls.refusal(_pretrain_main(), [*base, *extra, "--save", tmp_path / "ckpt"])
    assert flag in line and gib in line and "weights" in line, line
    assert snapshot(tmp_path) == {}


def test_weights_that_fit_the_gpu_but_not_the_host_are_not_refused(base):
    config, _ = parse_args([*base, "--kv-channels", "99999999"])  # 771.9 GiB
    assert weights_problem(config, host=16 * GIB, gpu=1024 * GIB) is None
    assert "more than this machine's 141.0 GiB of GPU memory" in weights_problem(config, host=16 * GIB, gpu=141 * GIB)
    assert weights_problem(parse_args(base)[0], host=1 * GIB, gpu=0) is None

LOGITS = torch.tensor([[0.5, 3.0, -1.0, 2.0], [10.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 1.0), (0, 0.9)])
def test_a_temperature_whose_logits_overflow_samples_the_most_likely_token(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    ids = sample(LOGITS, temperature, top_k, top_p, generator)
    assert ids.tolist() == [1, 0]


def test_a_small_temperature_that_does_not_overflow_still_samples():
    ids = sample(LOGITS, 1e-3, generator=torch.Generator().manual_seed(0))
    assert ids.tolist() == [1, 0]


@pytest.mark.parametrize("prompt,bad", [("def main(", "'def'"), ("1 2 x", "'x'"), ("1 -2", "'-2'"), ("1 128", "'128'")])
def test_a_null_tokenizer_prompt_that_is_not_token_ids_is_refused_naming_the_flag(prompt, bad):
    with pytest.raises(ValueError) as e:
        prompt_ids(NullTokenizer(128), prompt)
    line = str(e.value)
    assert line.startswith(f"--prompt: {bad} is not a token id") and "0 to 127" in line and "int()" not in line, line


def test_a_null_tokenizer_prompt_of_token_ids_is_those_ids():
    assert prompt_ids(NullTokenizer(128), " 1 2\t127 ") == [1, 2, 127]
