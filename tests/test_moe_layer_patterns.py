"""--moe-layer-freq by a grammar (config/flag_values.py parse_moe_layer_freq): an integer N >= 1, a list [0,1,...],
or Megatron-LM's ([0]*K+[1]*M) and nothing else; ASCII digits, the length bounded before a list is built. Every
tool refuses a bad pattern in one line naming the flag and both forms, and a resume compares patterns as the layer
lists they mean (issue 61, reproduction 2)."""
import pytest

from megatron_lite import arguments
from megatron_lite.config import Config, ConfigError, parse_moe_layer_freq
from megatron_lite.validation.resume import resume_differences
from tests import tool_calls
from tests.data.corpus_mix import load_tool

GOOD = [
    ("1", None),
    ("3", None),
    (" 2 ", None),
    ("[1]", (1,)),
    ("[0,1,1]", (0, 1, 1)),
    ("[0, 1]", (0, 1)),
    ("([0]*1+[1]*3)", (0, 1, 1, 1)),
    ("[0]*1+[1]*3", (0, 1, 1, 1)),
    ("([1,0]*2)", (1, 0, 1, 0)),
    ("([0]*2+[1,0]+[1]*1)", (0, 0, 1, 0, 1)),
]
BAD = [
    "[1,1",  # was [1,1]
    "[1,1]]]",  # was [1,1]
    "²",  # was a ValueError traceback (str.isdigit() holds for it, int() refuses it)
    "([1]*²)",  # the same, in a count
    "([0]*99999999999+[1]*1)",  # was a MemoryError: built before its length was checked
    "[1]*" + "9" * 5000,  # int() of over 4300 digits is a ValueError
    "0",
    "-1",
    "",
    "[]",
    "[2,1]",
    "([0]*1+[1]*3",
    "[0]*1+[1]*3)",
    "([1]*3))",
    "[1]*3*2",
    "3*[1]",
    "[1]+",
    "[1,,1]",
    "１",  # a full-width digit
    "__import__('os')",
    "[True,1]",
]


@pytest.mark.parametrize("text, pattern", GOOD)
def test_the_two_forms_parse_to_their_layers(text, pattern):
    assert parse_moe_layer_freq(text)[1] == pattern


@pytest.mark.parametrize("text", BAD, ids=[ascii(t) if len(t) < 40 else ascii(t[:30]) + "..." for t in BAD])
def test_anything_else_is_one_error_naming_the_flag_and_both_forms(text):
    with pytest.raises(ConfigError) as e:
        parse_moe_layer_freq(text)
    message = str(e.value)
    assert message.startswith("--moe-layer-freq") and "[0,1,1,1]" in message and "([0]*1+[1]*3)" in message, message
    assert "\n" not in message and len(message) < 400, message


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "8", "--num-experts", "4",
         "--moe-router-topk", "2"]
TOOL_CASES = ["[1,1", "[1,1]]]", "²", "([1]*²)", "([0]*99999999999+[1]*1)"]


def _clean_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("text", TOOL_CASES)
def test_pretrain_refuses_a_bad_pattern_in_one_line(text, monkeypatch):
    _clean_environment(monkeypatch)
    line = tool_calls.refusal(arguments.parse_args_or_exit, MODEL + ["--moe-layer-freq", text])
    assert "--moe-layer-freq" in line and "([0]*1+[1]*3)" in line, line


@pytest.mark.parametrize("text", TOOL_CASES)
def test_estimate_memory_refuses_a_bad_pattern_in_one_line(text):
    tool = load_tool("estimate_memory")
    line = tool_calls.refusal(tool.main, ["--world-size", "1", *MODEL, "--moe-layer-freq", text])
    assert "--moe-layer-freq" in line and "([0]*1+[1]*3)" in line, line


@pytest.mark.parametrize("text", TOOL_CASES)
def test_plan_refuses_a_bad_pattern_in_one_line_writing_nothing(text, tmp_path):
    tool = load_tool("tune_parallelism")
    output = tmp_path / "plan.json"
    line = tool_calls.refusal(tool.main, ["plan", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80",
                                          "--device", "cpu", "--output", output, *MODEL, "--moe-layer-freq", text])
    assert "--moe-layer-freq" in line and "([0]*1+[1]*3)" in line, line
    assert list(tmp_path.iterdir()) == []


def _moe(freq, layers=2):
    return Config().replace(model__num_experts=4, model__num_layers=layers, model__moe_layer_freq=freq)


@pytest.mark.parametrize("saved, new", [("1", "[1,1]"), ("1", "([1]*2)"), ("2", "[1,0]"), ("[0,1]", "([0]*1+[1]*1)")])
def test_a_resume_compares_patterns_as_the_layers_they_mean(saved, new):
    assert resume_differences(_moe(saved), _moe(new)) == []


def test_a_resume_with_other_moe_layers_is_refused_naming_both_patterns():
    problems = resume_differences(_moe("1"), _moe("[0,1]"))
    assert len(problems) == 1 and problems[0].startswith("--moe-layer-freq") and "[0,1]" in problems[0], problems
