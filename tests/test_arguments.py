"""The command line maps one to one onto the config dataclasses; every rule is validation's (tests/test_validation.py)."""
import argparse
import dataclasses

import pytest

from megatron_lite.arguments import (build_parser, config_from_args, config_to_argv, parse_args, parse_data_path,
                                     parse_split)
from megatron_lite.config import Config, ConfigError, flag_fields


def mapped(argv, world_size=1) -> Config:
    return config_from_args(build_parser().parse_args(argv), world_size)


def test_help_lists_megatron_flag_names():
    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                 "--global-batch-size", "--rampup-batch-size", "--num-layers", "--hidden-size",
                 "--num-attention-heads", "--seq-length", "--max-position-embeddings", "--train-iters", "--lr",
                 "--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--clip-grad", "--weight-decay", "--bf16",
                 "--fp16", "--data-path", "--split", "--tokenizer-type", "--tokenizer-model", "--save", "--load",
                 "--save-interval", "--eval-interval", "--eval-iters", "--log-interval", "--tensorboard-dir",
                 "--seed", "--zero-stage", "--deepspeed-config"):
        assert flag in text, flag


# Every flag pretrain_gpt.py had before the parser was generated from config.py (users' scripts use them).
FLAGS_BEFORE_GENERATION = """
--adam-beta1 --adam-beta2 --adam-eps --attention-backend --attention-dropout --attention-softmax-in-fp32 --bf16
--clip-grad --cpu-offload --data-cache-path --data-path --deepspeed-config --distributed-backend --eod-mask-loss
--eval-interval --eval-iters --exit-interval --exit-signal-handler --ffn-hidden-size --fp16 --global-batch-size
--gradient-accumulation-steps --hidden-dropout --hidden-size --hysteresis --init-method-std --initial-loss-scale
--keep-last --layernorm-epsilon --load --local-rank --local_rank --log-interval --loss-scale --loss-scale-window --lr
--lr-decay-iters --lr-decay-style --lr-warmup-iters --make-vocab-size-divisible-by --max-position-embeddings
--micro-batch-size --min-loss-scale --min-lr --no-masked-softmax-fusion --num-attention-heads --num-layers
--num-workers --pipeline-model-parallel-size --pipeline-partition-method --position-embedding-type
--rampup-batch-size --recompute-activations --rotary-base --save --save-interval --seed --seq-length --split
--tensor-model-parallel-size --tensorboard-dir --timing-breakdown --tokenizer-model --tokenizer-type --train-iters
--untie-embeddings-and-output-weights --vocab-size --weight-decay --zero-stage
""".split()


def test_every_flag_has_help_text_and_exactly_one_declared_default():
    """The parser declares no default: a flag left out leaves the dataclass default, the only one."""
    parser = build_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in actions:
        assert action.help and len(action.help) > 10, action.option_strings
        assert action.default is argparse.SUPPRESS, f"{action.option_strings} declares default {action.default!r}"
    assert vars(parser.parse_args([])) == {}
    # Each flag field: a default in its dataclass (not a factory), and one flag per field.
    flags = [f.metadata["flag"] for _, f in flag_fields()]
    assert len(flags) == len(set(flags))
    for section, f in flag_fields():
        assert f.default is not dataclasses.MISSING, f"{section}.{f.name}"


def test_every_config_field_has_a_flag_unless_derived():
    """A field without a flag must be one validation or the launcher fills."""
    derived = {"padded_vocab_size", "data_parallel_size", "world_size", "deepspeed_config_contents"}
    with_flag = {f.name for _, f in flag_fields()}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            assert f.name in with_flag or f.name in derived, f"{section.name}.{f.name} has no flag"


def test_no_flag_is_lost_and_each_field_docstring_is_its_help():
    text = build_parser().format_help()
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert set(FLAGS_BEFORE_GENERATION) <= options
    assert "Pad the vocabulary to a multiple of this x TP so it splits evenly. (default: 128)" in " ".join(text.split())


def test_pipeline_partition_method_help_lists_profile():
    action = next(a for a in build_parser()._actions if "--pipeline-partition-method" in a.option_strings)
    for method in ("cost", "profile", "uniform", "parameters", "type:<regex>", "3,3,2"):
        assert method in action.help, method


def test_choices_nargs_and_boolean_flags_keep_their_syntax():
    config = mapped(["--zero-stage", "1", "--rampup-batch-size", "4", "4", "100", "--no-masked-softmax-fusion",
                     "--local_rank", "3", "--position-embedding-type", "rope", "--bf16"])
    assert config.parallel.zero_stage == 1 and config.batch.rampup_batch_size == (4, 4, 100)
    assert config.model.masked_softmax_fusion is False and config.model.position_embedding_type == "rope"
    assert config.precision.bf16 and mapped(["--local-rank=1"]) == mapped([])
    for bad in (["--zero-stage", "4"], ["--rampup-batch-size", "4", "4"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


@pytest.mark.parametrize("argv", [
    [],
    ["--num-layers", "6", "--hidden-size", "96", "--lr", "0.0003", "--min-lr", "3e-05", "--bf16", "--split", "98,2,0"],
    ["--data-path", "0.3", "a", "0.7", "b", "--rampup-batch-size", "8", "8", "1000", "--no-masked-softmax-fusion",
     "--no-attention-softmax-in-fp32", "--zero-stage", "1", "--cpu-offload", "--initial-loss-scale", "1024.0"],
    ["--data-path", "corpus_text_document", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
     "--pipeline-partition-method", "2,1", "--log-level", "info", "--recompute-activations"],
])
def test_config_to_argv_is_the_inverse_of_parsing(argv):
    config = mapped(argv)
    assert mapped(config_to_argv(config)) == config
    assert sorted(config_to_argv(config)) == sorted(config_to_argv(mapped(config_to_argv(config))))


def test_config_to_argv_writes_only_the_fields_asked_for():
    config = mapped(["--num-layers", "6", "--tensor-model-parallel-size", "2", "--cpu-offload"])
    assert config_to_argv(config, sections=("parallel",)) == ["--tensor-model-parallel-size", "2", "--cpu-offload"]
    assert config_to_argv(config, fields=("num_layers",)) == ["--num-layers", "6"]


def test_mapping_checks_and_derives_nothing():
    # Contradictory flags map as given; validation is what refuses them.
    config = mapped(["--bf16", "--fp16", "--micro-batch-size", "4", "--tensor-model-parallel-size", "3"], world_size=2)
    assert config.precision.bf16 and config.precision.fp16
    assert config.batch.micro_batch_size == 4 and config.batch.global_batch_size is None
    assert config.parallel.world_size == 2 and config.parallel.data_parallel_size is None
    assert config.model.ffn_hidden_size is None and config.model.padded_vocab_size is None


def test_data_path_and_split_are_typed_once():
    config = mapped(["--data-path", "0.3", "a", "0.7", "b", "--split", "98,2"])
    assert config.data.data_path == ((0.3, "a"), (0.7, "b"))
    assert config.data.split == (98.0, 2.0, 0.0)
    assert parse_data_path(["corpus_text_document"]) == ((1.0, "corpus_text_document"),)
    assert parse_split("969/30/1") == (969.0, 30.0, 1.0)


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "0.3", "a", "0.7"], r"^--data-path takes one prefix or weight/prefix pairs"),
    (["--data-path", "x", "a", "0.7", "b"], r"^--data-path weight 'x' \(before 'a'\) is not a number"),
    (["--split", "90,x,1"], r"^--split '90,x,1' must be up to three comma-separated numbers"),
    (["--split", "1,2,3,4"], r"^--split '1,2,3,4' must be up to three"),
])
def test_flag_syntax_errors_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        mapped(argv)


def test_attention_softmax_in_fp32_can_be_switched_off():
    assert mapped([]).model.attention_softmax_in_fp32 is True
    assert mapped(["--no-attention-softmax-in-fp32"]).model.attention_softmax_in_fp32 is False


def test_parse_args_validates_what_it_maps():
    config, notes = parse_args(["--hidden-size", "128", "--num-attention-heads", "8"], world_size=4)
    assert config.parallel.data_parallel_size == 4 and config.model.ffn_hidden_size == 512
    with pytest.raises(ConfigError, match=r"^--bf16 and --fp16 were both given"):
        parse_args(["--bf16", "--fp16"], world_size=1)


def test_world_size_comes_from_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    config, _ = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                            "--num-layers", "4"])
    assert config.parallel.data_parallel_size == 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    config, _ = parse_args([])
    assert config.parallel.world_size == 4
