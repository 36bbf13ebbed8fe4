"""tune_parallelism.py refuses bad input in one line (exit 2) naming the flag or file and what works, before it
writes anything or measures: a plan file that is not a plan, a --results that is a file, an --only that names no
candidate, a launcher template with an unknown placeholder, a report of a folder no sweep wrote, and model flags
that pretrain_gpt.py would refuse at every layout (plan and calibrate check them once, up front).

Each tool's main() runs in this process (tests/tool_calls.py): a refusal costs milliseconds.
"""
import json
import os

import pytest

from tests import tool_calls
from tests.data.corpus_mix import load_tool

TOOL = load_tool("tune_parallelism")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "128", "--global-batch-size", "8"]
PLAN = ["plan", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80", "--device", "cpu", *MODEL]
CALIBRATE = ["calibrate", "--world-size", "1", "--gemm-tokens", "8", "--gemm-hidden", "8", "--copy-megabytes", "1",
             "--min-seconds", "0.01", "--iters", "1"]
CANDIDATE = {"name": "001_tp1_cp1_pp1_dp1_mb1", "layout": "tp1_cp1_pp1_dp1_mb1", "tensor_model_parallel_size": 1,
             "context_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
             "expert_model_parallel_size": 1, "micro_batch_size": 1, "saver": "none", "rank": 1,
             "pretrain_argv": MODEL + ["--micro-batch-size", "1"]}
GOOD_PLAN = {"mode": "layout", "cluster": {"nodes": 1, "gpus_per_node": 1}, "candidates": [CANDIDATE]}
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}

# (case, the plan file's contents, sweep flags after --plan/--results, words the refusal line must hold)
SWEEP_CASES = [
    ("an HF config.json as --plan", HF_CONFIG, [], ["--plan", "candidates"]),
    ("a JSON list as --plan", [1, 2], [], ["--plan", "tune_parallelism.py plan"]),
    ("candidates not a list", {"cluster": GOOD_PLAN["cluster"], "candidates": "x"}, [], ["--plan", "candidates"]),
    ("a candidate name not a string", {**GOOD_PLAN, "candidates": [{**CANDIDATE, "name": 7}]}, [],
     ["--plan", "name"]),
    ("a candidate without pretrain_argv", {**GOOD_PLAN, "candidates": [{"name": "a"}]}, [], ["--plan",
                                                                                           "pretrain_argv"]),
    ("--only naming no candidate", GOOD_PLAN, ["--only", "tp8"], ["--only", "tp8", CANDIDATE["name"]]),
    ("--launcher with an unknown placeholder", GOOD_PLAN, ["--launcher", "{bogus} python"],
     ["--launcher", "{bogus}", "{world_size}"]),
    ("--launcher with a stray brace", GOOD_PLAN, ["--launcher", "torchrun --nproc_per_node {nproc_per_node"],
     ["--launcher"]),
]


def _write(path, contents):
    with open(path, "w") as f:
        json.dump(contents, f)
    return str(path)


def _refusal_writes_nothing(tmp_path, argv):
    """The refusal line of main(argv), checking that nothing under tmp_path changed."""
    before = tool_calls.snapshot(tmp_path)
    line = tool_calls.refusal(TOOL.main, argv)
    assert tool_calls.snapshot(tmp_path) == before, "a refusal wrote files"
    return line


@pytest.mark.parametrize("case,contents,flags,words", SWEEP_CASES, ids=[c[0] for c in SWEEP_CASES])
def test_sweep_refuses_a_bad_plan_only_or_launcher_before_creating_results(tmp_path, case, contents, flags, words):
    plan = _write(tmp_path / "plan.json", contents)
    launcher = [] if "--launcher" in flags else ["--launcher", "{script}"]
    line = _refusal_writes_nothing(tmp_path, ["sweep", "--plan", plan, "--results", tmp_path / "sweep",
                                              *launcher, *flags, "--", "--data-path", "x"])
    for word in words:
        assert word in line, (word, line)
    assert not os.path.exists(tmp_path / "sweep")


def test_sweep_refuses_a_results_path_that_is_a_file(tmp_path):
    plan = _write(tmp_path / "plan.json", GOOD_PLAN)
    _write(tmp_path / "results", {})
    line = _refusal_writes_nothing(tmp_path, ["sweep", "--plan", plan, "--results", tmp_path / "results",
                                              "--launcher", "{script}"])
    assert "--results" in line and "is a file" in line, line


def test_report_refuses_a_folder_no_sweep_wrote(tmp_path):
    (tmp_path / "notes").mkdir()
    line = _refusal_writes_nothing(tmp_path, ["report", "--results", tmp_path])
    assert "--results" in line and "sweep" in line, line


# (case, model flags added to PLAN's, the flags the refusal must name)
MODEL_CASES = [
    ("topk above experts", ["--num-experts", "3", "--moe-router-topk", "4"], ["--moe-router-topk", "--num-experts"]),
    ("a layer pattern of the wrong length", ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq",
                                             "[1,1,1]"], ["--moe-layer-freq"]),
]


@pytest.mark.parametrize("case,flags,named", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_plan_refuses_model_flags_every_layout_would_refuse_naming_the_flag(tmp_path, case, flags, named):
    line = _refusal_writes_nothing(tmp_path, [*PLAN, *flags, "--output", tmp_path / "plan.json"])
    for flag in named:
        assert flag in line, (flag, line)


def test_calibrate_refuses_model_flags_before_measuring(tmp_path):
    argv = [*CALIBRATE, "--output", tmp_path / "profile.json", "--", *MODEL, "--num-experts", "4",
            "--moe-router-topk", "5"]
    code, out, err = tool_calls.call(TOOL.main, argv)
    assert code == 2 and out == "", (code, out, err)  # no measurement's progress line before the refusal
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "--moe-router-topk" in lines[0] and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []
