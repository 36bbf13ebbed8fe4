"""Mixture-of-Experts flags that cannot work are refused in one line naming the flag, the value and one that
would, before torch.distributed starts (validation/moe.py)."""
import pytest

from megatron_lite import arguments
from tests.tool_calls import refusal

MOE = ["--num-experts", "8", "--num-layers", "4", "--micro-batch-size", "1", "--vocab-size", "128"]

CASES = [
    ("4", MOE + ["--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size 3 does not divide data-parallel 4 x context-parallel 1 = 4"),
    ("4", ["--num-experts", "6", "--expert-model-parallel-size", "4", "--micro-batch-size", "1", "--vocab-size", "64"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    ("1", MOE + ["--moe-router-topk", "9"], "--moe-router-topk 9 is more than --num-experts 8"),
    ("1", MOE + ["--moe-layer-freq", "[0,1,1]"], "--moe-layer-freq [0,1,1] has 3 entries for --num-layers 4"),
    ("1", MOE + ["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq '__import__('os')' must be an integer"),
    ("2", ["--expert-model-parallel-size", "2", "--micro-batch-size", "1", "--vocab-size", "64"],
     "--expert-model-parallel-size 2 configure Mixture-of-Experts layers, which need --num-experts"),
    ("1", MOE + ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups 3 does not divide --num-experts 8"),
    ("1", MOE + ["--moe-router-group-topk", "2"], "--moe-router-num-groups and --moe-router-group-topk go together"),
    ("2", MOE + ["--zero-stage", "2"], "--num-experts with --zero-stage 2"),
    ("2", MOE + ["--expert-model-parallel-size", "2", "--save", "{tmp}/ckpt"],
     "--save with --expert-model-parallel-size 2 at --zero-stage 0 in fp32"),
    ("1", MOE + ["--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid"],
     "--moe-router-pre-softmax orders softmax and top-k; it needs --moe-router-score-function softmax"),
    ("1", MOE + ["--moe-shared-expert-gate"], "--moe-shared-expert-gate gates the shared expert; add"),
    ("2", MOE + ["--tensor-model-parallel-size", "2", "--moe-ffn-hidden-size", "45"],
     "--moe-ffn-hidden-size 45 is not divisible by --tensor-model-parallel-size 2"),
    ("1", MOE + ["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor: must be more than 0"),
    # Hung before the rule (stage 1 in an all-reduce stage 0 never joins: validation/moe.py).
    ("2", MOE + ["--moe-layer-freq", "[0,0,1,1]", "--pipeline-model-parallel-size", "2", "--bf16"],
     "pipeline stage 0 of --pipeline-model-parallel-size 2 holds no MoE layer"),
]


def test_a_pipeline_stage_without_moe_layers_is_allowed_but_in_bf16_at_zero_0(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pp2 = MOE + ["--pipeline-model-parallel-size", "2"]
    arguments.parse_args(pp2 + ["--moe-layer-freq", "[0,0,1,1]"])
    arguments.parse_args(pp2 + ["--moe-layer-freq", "[0,0,1,1]", "--zero-stage", "1"])
    arguments.parse_args(pp2 + ["--moe-layer-freq", "[0,0,1,1]", "--zero-stage", "1", "--bf16"])
    arguments.parse_args(pp2 + ["--moe-layer-freq", "[0,0,1,1]", "--pipeline-partition-method", "3,1", "--bf16"])


@pytest.mark.parametrize("world, argv, line", CASES, ids=[c[2].split(" ")[0] + str(i) for i, c in enumerate(CASES)])
def test_moe_flags_that_cannot_work_are_refused_in_one_line(world, argv, line, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", world)
    for name in ("RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    error = refusal(arguments.parse_args_or_exit, argv)
    assert line in error, error
    assert not (tmp_path / "ckpt").exists()


def test_the_layer_pattern_and_the_every_nth_form_choose_megatron_lms_layers():
    from megatron_lite.model.moe_options import moe_layer_pattern

    def pattern(freq, layers=6):
        config, _ = arguments.parse_args(["--num-experts", "4", "--moe-layer-freq", freq, "--num-layers", str(layers),
                                          "--micro-batch-size", "1", "--vocab-size", "64"], world_size=1)
        return moe_layer_pattern(config.model)

    assert pattern("1") == (True,) * 6
    assert pattern("2") == (True, False, True, False, True, False)  # Megatron-LM: layer i is MoE when i % N == 0
    assert pattern("([0]*1+[1]*5)") == (False,) + (True,) * 5
    assert pattern("[0,1,0,1,1,1]") == (False, True, False, True, True, True)
