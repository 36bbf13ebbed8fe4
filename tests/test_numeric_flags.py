"""Every numeric flag of pretrain_gpt.py and of the model, checkpoint, tuning and inference tools refuses a value
that is not finite, a fraction where a count is meant, out of its range or huge: exit 2, one line naming the
flag, the value and one that works, before anything is read or written. (The data tools' own table is
tests/data/test_tool_refusals.py.)

Each tool's main() runs in this process: argparse refuses the number before the tool looks at its inputs, so
the inputs of these cases need not exist.
"""
import re

import pytest

from megatron_lite import arguments
from megatron_lite.flag_numbers import WHOLE_MAX
from megatron_lite.tuning import report, sweep
from tests.data.corpus_mix import load_tool
from tests.tool_calls import refusal, snapshot

TOOLS = {name: load_tool(name) for name in ("convert_checkpoint", "tune_parallelism", "estimate_memory",
                                            "generate", "evaluate")}
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128"]

# Refused by every numeric flag whatever its range.
ALWAYS_BAD = ["nan", "inf", "-inf", "1e30", "99999999999999"]
UNBOUNDED = {"--lr": ["nan", "inf", "-inf", "1e400"], "--min-lr": ["nan", "inf", "-inf", "1e400"]}
"""Flags with no maximum, and what is refused of the huge: a learning rate of 1e30 is how a run is made to
diverge on purpose (tests/training/test_pretrain_e2e.py), so only one that overflows to inf is refused."""

# pretrain_gpt.py: flag -> its own out-of-range values (below its minimum, 0 where 0 means nothing, above its
# maximum, a fraction for a count).
PRETRAIN = {
    "--num-layers": ["-1", "0", "2.5"], "--hidden-size": ["0"], "--num-attention-heads": ["0"],
    "--ffn-hidden-size": ["0"], "--seq-length": ["0"], "--max-position-embeddings": ["0"], "--vocab-size": ["0"],
    "--make-vocab-size-divisible-by": ["0"], "--hidden-dropout": ["-0.1", "1"], "--attention-dropout": ["1.5"],
    "--rotary-base": ["0"], "--init-method-std": ["-0.02", "101"], "--norm-epsilon": ["0", "-1e-5", "2"],
    "--num-query-groups": ["0"], "--kv-channels": ["0", "-8", "12.5"], "--rope-scaling-factor": ["0.5", "2000"],
    "--rotary-scaling-factor": ["0.5", "2000"], "--yarn-original-max-position-embeddings": ["0", "4096.5"],
    "--yarn-beta-fast": ["0", "-32"], "--yarn-beta-slow": ["0"], "--mscale": ["-1"], "--mscale-all-dim": ["-0.5"],
    "--rotary-percent": ["0", "1.5"], "--q-lora-rank": ["0"], "--kv-lora-rank": ["0"], "--qk-head-dim": ["0"],
    "--qk-pos-emb-head-dim": ["1"], "--v-head-dim": ["0"], "--mtp-num-layers": ["0"],
    "--mtp-loss-scaling-factor": ["-0.1", "1e7"], "--glu-linear-offset": ["-2e6", "2e6"],
    "--activation-func-clamp-value": ["0", "-7", "2e6"], "--output-loss-chunk-size": ["0", "-1", "2.5"],
    "--recompute-num-layers": ["0"], "--window-attn-skip-freq": ["0", "-2"],
    "--num-experts": ["0", "1.5"], "--moe-ffn-hidden-size": ["0"], "--moe-router-topk": ["0"],
    "--moe-router-topk-scaling-factor": ["0", "-1", "1e7"], "--moe-router-num-groups": ["0"],
    "--moe-router-group-topk": ["0"], "--moe-aux-loss-coeff": ["-1", "1e7"], "--moe-z-loss-coeff": ["-0.1"],
    "--moe-router-bias-update-rate": ["-1e-3"], "--moe-shared-expert-intermediate-size": ["0"],
    "--moe-expert-capacity-factor": ["0", "-1"], "--expert-model-parallel-size": ["0"],
    "--tensor-model-parallel-size": ["0"], "--pipeline-model-parallel-size": ["0"],
    "--context-parallel-size": ["0"], "--zero-stage": [], "--distributed-timeout-minutes": ["0", "-1", "1e15"],
    "--micro-batch-size": ["0"], "--global-batch-size": ["0"], "--gradient-accumulation-steps": ["0"],
    "--lr": ["0", "-1e-4"], "--min-lr": ["-1"], "--lr-warmup-iters": ["-1"], "--lr-decay-iters": ["0"],
    "--weight-decay": ["-0.1"], "--adam-beta1": ["1", "-0.1"], "--adam-beta2": ["1.5"], "--adam-eps": ["0"],
    "--clip-grad": ["-1", "1e7"], "--muon-momentum": ["1", "-0.1"], "--muon-num-ns-steps": ["0", "100"],
    "--muon-extra-scale-factor": ["0", "1e4"], "--loss-scale": ["0"], "--initial-loss-scale": ["0", "1e20"],
    "--min-loss-scale": ["0", "2e12"], "--loss-scale-window": ["0"], "--hysteresis": ["0"], "--num-workers": ["-1"],
    "--train-iters": ["0"], "--eval-interval": ["0"], "--eval-iters": ["-1"], "--save-interval": ["0"],
    "--keep-last": ["0"], "--exit-interval": ["0"], "--iterations-to-skip": ["0", "-3"], "--seed": ["-1"],
    "--log-interval": ["0"],
    "--skip-update-sigma": ["0", "-1", "2e6"], "--skip-update-window": ["1", "2.5"],
    "--straggler-minmax-count": ["0"],
    "--watchdog-startup-timeout-minutes": ["0", "1e15"], "--watchdog-step-timeout-minutes": ["0", "-1"],
    "--watchdog-checkpoint-timeout-minutes": ["0"], "--watchdog-evaluation-timeout-minutes": ["0"],
    "--watchdog-timeout-factor": ["0.5", "1e7"], "--watchdog-min-timeout-minutes": ["0"],
}
RAMPUP = ("--rampup-batch-size", ["0 1 1", "1 -1 1", "1 1 nan", "1 1 99999999999999"])

# tool (its prog) -> (argv it otherwise accepts up to the numbers, {flag: own out-of-range values}).
# {missing}: an input that does not exist; {out}: an output not there yet.
LOAD = ["--load", "{missing}"]
TARGETS = ["--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]
NUMBERS = {
    "convert_checkpoint.py merge": (["merge", *LOAD, "--output", "{out}"], {"--iteration": ["-1", "0.5"]}),
    "convert_checkpoint.py reshard": (["reshard", *LOAD, "--save", "{out}", *TARGETS], {
        "--iteration": ["-1"], "--target-tensor-model-parallel-size": ["0", "-1", "1.5"],
        "--target-pipeline-model-parallel-size": ["0", "-2"]}),
    "convert_checkpoint.py universal": (["universal", *LOAD, "--save", "{out}"], {"--iteration": ["-1"]}),
    "convert_checkpoint.py export-hf": (["export-hf", *LOAD, "--output", "{out}"], {"--iteration": ["-1"]}),
    "convert_checkpoint.py import-hf": (["import-hf", "--input", "{missing}", "--output", "{out}"], {
        "--target-tensor-model-parallel-size": ["0"], "--target-pipeline-model-parallel-size": ["0"],
        "--seq-length": ["0", "-128"], "--target-expert-model-parallel-size": ["0"]}),
    "tune_parallelism.py plan": (["plan", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80", *MODEL], {
        "--nodes": ["0", "-1"], "--gpus-per-node": ["0"], "--gpu-memory-gb": ["0", "-80", "70000"],
        "--memory-margin": ["-0.1", "1"], "--max-micro-batch": ["0"], "--probe-layers": ["0"],
        "--max-context-parallel": ["0"], "--max-expert-parallel": ["0"], "--peak-tflops": ["0", "2e6"],
        "--intra-node-gbps": ["0"],
        "--inter-node-gbps": ["-25"], "--show": ["-1"]}),
    "tune_parallelism.py calibrate": (["calibrate", "--output", "{out}"], {
        "--world-size": ["0"], "--gemm-tokens": ["0", "-128"], "--gemm-hidden": ["0"],
        "--copy-megabytes": ["0", "2000000"], "--message-bytes": ["3", "0"], "--iters": ["0"],
        "--min-seconds": ["0", "3601"], "--threads": ["0"], "--micro-batches": ["0"], "--model-reps": ["0"],
        "--model-passes": ["0"], "--max-context-parallel": ["0"], "--max-expert-parallel": ["-2"]}),
    "tune_parallelism.py sweep": (["sweep", "--plan", "{missing}", "--results", "{out}", "--launcher", "x"], {
        "--train-iters": ["1", "0"], "--warmup-iters": ["-1"], "--time-limit": ["0", "1e7"], "--max-runs": ["0"],
        "--repeats": ["0"]}),
    "tune_parallelism.py report": (["report", "--results", "{missing}"], {}),
    "estimate_memory.py": (["--world-size", "1", *MODEL], {
        "--world-size": ["0"], "--gpu-memory-gb": ["0", "70000"], "--memory-margin": ["1", "-0.5"],
        "--sequence-step": ["0"]}),
    "generate.py": ([*LOAD, "--prompt", "x"], {
        "--iteration": ["-1"], "--max-new-tokens": ["0", "2000000"], "--temperature": ["-0.1", "101"],
        "--top-k": ["-1"], "--top-p": ["0", "1.1"], "--seed": ["-1"]}),
    "evaluate.py": (LOAD, {
        "--iteration": ["-1"], "--eval-iters": ["0"], "--tensor-model-parallel-size": ["0"],
        "--pipeline-model-parallel-size": ["0"], "--expert-model-parallel-size": ["0"], "--global-batch-size": ["0"]}),
}


def _main(prog):
    name = prog.split()[0][:-len(".py")]
    return TOOLS[name].main


def assert_refused(main, prog, argv, flag, value, tmp_path):
    paths = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out")}
    before = snapshot(tmp_path)
    line = refusal(main, [a.format(**paths) for a in argv])
    assert re.match(rf"{re.escape(prog)}: error: argument {flag}(/--[a-z-]+)*: must be", line), line
    assert f"got {value}; e.g. " in line, line
    assert snapshot(tmp_path) == before


def _pretrain_cases():
    cases = [(flag, value) for flag, own in PRETRAIN.items() for value in UNBOUNDED.get(flag, ALWAYS_BAD) + own]
    return cases + [(RAMPUP[0], value) for value in RAMPUP[1]]


@pytest.mark.parametrize("flag,value", _pretrain_cases())
def test_every_numeric_flag_of_pretrain_gpt_refuses_nan_inf_negative_zero_and_huge(flag, value, tmp_path):
    values = value.split()
    argv = [f"{flag}={value}"] if len(values) == 1 else [flag, *values]  # argparse reads -inf as a flag
    bad = next(v for v in values if v not in ("1",)) if len(values) > 1 else value
    assert_refused(arguments.parse_args_or_exit, "pretrain_gpt.py", argv, flag, bad, tmp_path)


def _tool_cases():
    return [(prog, argv, flag, value) for prog, (argv, flags) in NUMBERS.items() for flag, own in flags.items()
            for value in ALWAYS_BAD + own]


@pytest.mark.parametrize("prog,argv,flag,value", _tool_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numeric_flag_of_the_model_checkpoint_tuning_and_inference_tools_refuses_bad_numbers(prog, argv, flag,
                                                                                                 value, tmp_path):
    assert_refused(_main(prog), prog, [*argv, f"{flag}={value}"], flag, value, tmp_path)


def _parsers():
    """prog -> argparse parser, for every command in the tables."""
    parsers = {"pretrain_gpt.py": arguments.build_parser()}
    commands = TOOLS["convert_checkpoint"].build_parser()._subparsers._group_actions[0].choices
    parsers.update({f"convert_checkpoint.py {name}": parser for name, parser in commands.items()})
    parsers["tune_parallelism.py plan"] = TOOLS["tune_parallelism"].plan_parser()
    parsers["tune_parallelism.py calibrate"] = TOOLS["tune_parallelism"].calibrate_parser()
    parsers["tune_parallelism.py sweep"] = sweep.build_parser()
    parsers["tune_parallelism.py report"] = report.build_parser()
    for name in ("estimate_memory", "generate", "evaluate"):
        parsers[f"{name}.py"] = TOOLS[name].build_parser()
    return parsers


def _checked(action):
    """Whether the flag's type is flag_numbers.number()'s."""
    return getattr(action.type, "__qualname__", "").startswith("number.")


def test_every_numeric_flag_is_in_the_tables_and_goes_through_the_one_number_rule():
    """A numeric flag added later without a row here, or read with a bare int() (which takes nan for a float
    and -1 for a count), fails this test."""
    for prog, parser in _parsers().items():
        actions = [a for a in parser._actions if a.option_strings]
        numeric = {a.option_strings[0] for a in actions if a.type in (int, float) or _checked(a)}
        expected = set(PRETRAIN) | {RAMPUP[0]} if prog == "pretrain_gpt.py" else set(NUMBERS[prog][1])
        assert numeric - {"--local-rank"} == expected, prog
        assert all(_checked(a) for a in actions if a.type in (int, float) and a.option_strings[0] != "--local-rank")


def test_a_number_in_range_is_taken_and_a_whole_number_at_the_limit_is_still_one():
    config = arguments.parse_args_or_exit(["--seed", str(WHOLE_MAX), "--lr", "10", "--adam-beta2", "0.99"])
    assert (config.training.seed, config.optimizer.lr, config.optimizer.adam_beta2) == (WHOLE_MAX, 10.0, 0.99)
    line = refusal(arguments.parse_args_or_exit, ["--seed", str(WHOLE_MAX + 1)])
    assert f"--seed: must be at most {WHOLE_MAX}, got {WHOLE_MAX + 1}" in line, line
