"""A flag that acts only with another is declared beside it (`needs=` in config/, option.py Needs) and refused
without it by one rule (validation/dependent_flags.py), in one line naming the flag and what to add, before any
process group (issue 61, reproduction 1): a user who types --moe-router-topk 3 without --num-experts is told,
instead of training a dense model."""
import dataclasses
import typing

import pytest

from megatron_lite import arguments
from megatron_lite.config import Config, ConfigError, flag_fields
from megatron_lite.validation.dependent_flags import dependent_flag_rules
from tests.tool_calls import refusal

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--vocab-size", "128"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]

# (argv, what the one line says): each trained as asked for something else before the rule.
REPRODUCTIONS = [
    (["--moe-layer-freq", "[0,1]"], "--moe-layer-freq [0,1] configure Mixture-of-Experts layers"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm configure Mixture-of-Experts layers"),
    (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid configure Mixture-of-Experts"),
    (["--moe-aux-loss-coeff", "0.5"], "--moe-aux-loss-coeff 0.5 configure Mixture-of-Experts layers"),
    (["--moe-router-topk", "3"], "--moe-router-topk 3 configure Mixture-of-Experts layers, which need --num-experts"),
    (["--moe-router-topk", "3", "--moe-grouped-gemm"], "--moe-router-topk 3, --moe-grouped-gemm configure"),
    (["--moe-ffn-hidden-size", "32"], "--moe-ffn-hidden-size 32 configure Mixture-of-Experts layers"),
    (["--moe-z-loss-coeff", "0.1"], "--moe-z-loss-coeff 0.1 configure Mixture-of-Experts layers"),
    (MOE + ["--moe-token-drop-policy", "position"], "--moe-token-drop-policy position"),
    (MOE + ["--moe-router-bias-update-rate", "0.1"], "--moe-router-bias-update-rate 0.1"),
    (MOE + ["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.1"],
     "--moe-aux-loss-coeff 0.1"),
    (["--muon-momentum", "0.5"], "--muon-momentum 0.5"),
    (["--window-size", "3", "--window-attn-skip-freq", "1"], "--window-attn-skip-freq 1"),
    (MOE + ["--moe-layer-freq", "[0,0]"], "--moe-layer-freq [0,0]"),
]
ADDS = {"--moe-token-drop-policy": "--moe-expert-capacity-factor", "--moe-router-bias-update-rate":
        "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff 0.1": "--moe-router-load-balancing-type",
        "--muon-momentum": "--optimizer muon", "--window-attn-skip-freq 1": "--window-size",
        "--moe-layer-freq [0,0]": "--num-experts"}


def _one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("argv, says", REPRODUCTIONS, ids=[" ".join(a) for a, _ in REPRODUCTIONS])
def test_a_flag_that_would_do_nothing_is_refused_in_one_line(argv, says, monkeypatch, tmp_path):
    _one_process(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = refusal(arguments.parse_args_or_exit, BASE + argv)
    assert says in line, line
    for flag, add in ADDS.items():
        if says.startswith(flag):
            assert add in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_muon_runs_first_screen_names_muon():
    from megatron_lite.training.console import layout_summary

    config, _ = arguments.parse_args(BASE + ["--optimizer", "muon"], world_size=1)
    line = layout_summary(config, "gloo", "cpu")
    assert "optimizer Muon" in line and "optimizer AdamW" not in line, line


# --- every declaration, walked ---

# Values of fields whose flag form the walk cannot derive from the field (no choices, not a number or a bool).
EXAMPLES = {"moe_layer_freq": "[1,0]", "window_size": "7"}
# A value making a Needs' field hold, where its default does not and it is neither a bool nor a choice.
HOLDING = {"num_experts": 4, "moe_expert_capacity_factor": 1.0, "moe_shared_expert_intermediate_size": 64,
           "window_size": (7, 0)}


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _declared():
    """(section, field, its needs) of every field declaring needs."""
    for section, f in flag_fields():
        if f.metadata.get("needs"):
            yield section, f, f.metadata["needs"]


def _field(path):
    section, name = path.split(".")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def _flag_value(f, value):
    """The flag and its text giving field `f` the value `value`."""
    meta = f.metadata
    if isinstance(f.default, bool):
        if meta.get("action") == "boolean_optional":
            return [meta["flag"] if value else "--no-" + meta["flag"][2:]]
        assert value != f.default
        return [meta["flag"]]
    if "unparse" in meta:
        return [meta["flag"], *meta["unparse"](value)]
    return [meta["flag"], str(value)]


def _other_value(section, f):
    """A valid value of field `f` other than its default."""
    meta = f.metadata
    if f.name in EXAMPLES:
        return meta["parse"](EXAMPLES[f.name]) if "parse" in meta else EXAMPLES[f.name]
    if isinstance(f.default, bool):
        return not f.default
    if "choices" in meta:
        return next(c for c in meta["choices"] if c != f.default)
    hint = typing.get_type_hints(SECTIONS[section])[f.name]
    kind = int if int in (hint, *typing.get_args(hint)) else float
    low = meta.get("minimum", meta.get("above", 0))
    for value in (f.default * 2 if f.default else None, low + 1, (low + meta.get("below", low + 1)) / 2):
        if (value is not None and value != f.default and value < meta.get("below", float("inf"))
                and value <= meta.get("maximum", float("inf"))):
            return kind(value)
    raise AssertionError(f"no example value for {f.name}: add it to EXAMPLES")


def _making(needs, holds):
    """The flags making `needs` hold (or fail): its field's default where that does, else another value."""
    f = _field(needs.path)
    if needs.holds(f.default) == holds:
        return []
    meta = f.metadata
    values = ([not f.default] if isinstance(f.default, bool) else list(meta.get("choices", ()))
              + ([HOLDING[f.name]] if f.name in HOLDING else []))
    value = next(v for v in values if needs.holds(v) == holds)
    return _flag_value(f, value)


CASES = [(section, f, i) for section, f, needs in _declared() for i in range(len(needs))]


def test_the_walk_covers_the_declarations_the_issue_names():
    names = {f.name for _, f, _ in CASES}
    for name in ("moe_router_topk", "moe_layer_freq", "moe_grouped_gemm", "moe_aux_loss_coeff", "moe_token_drop_policy",
                 "moe_router_bias_update_rate", "moe_shared_expert_gate", "expert_model_parallel_size",
                 "muon_momentum", "muon_tp_mode", "window_attn_skip_freq"):
        assert name in names, name


@pytest.mark.parametrize("section, f, index", CASES, ids=[f"{f.name}-{i}" for _, f, i in CASES])
def test_every_declared_flag_is_refused_without_what_it_needs_and_taken_with_it(section, f, index, monkeypatch):
    needs = f.metadata["needs"]
    flag = _flag_value(f, _other_value(section, f))
    holding = [a for n in needs[:index] for a in _making(n, True)]
    argv = BASE + holding + _making(needs[index], False) + flag
    config = arguments.config_from_argv(argv)
    with pytest.raises(ConfigError) as e:
        dependent_flag_rules(config, [])
    line = str(e.value)
    assert line.startswith(flag[0]) and needs[index].add in line and "\n" not in line, (argv, line)
    # Every Needs satisfied: this rule takes it (others may still refuse the combination).
    argv = BASE + [a for n in needs for a in _making(n, True)] + flag
    dependent_flag_rules(arguments.config_from_argv(argv), [])
