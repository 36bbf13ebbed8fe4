"""The command line maps one to one onto the config dataclasses; every rule is validation's (tests/test_validation.py)."""
import dataclasses

import pytest

from megatron_lite.arguments import build_parser, config_from_args, parse_args, parse_data_path, parse_split
from megatron_lite.config import Config, ConfigError


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


def test_every_config_field_a_flag_sets_has_that_flag():
    """The mapping is by name, so a renamed field or flag cannot silently drop a setting."""
    derived = {"padded_vocab_size", "data_parallel_size", "world_size", "deepspeed_config_contents"}
    flags = {a.dest for a in build_parser()._actions}
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default_factory):
            if field.name not in derived:
                assert field.name in flags, f"{section.name}.{field.name} has no flag"


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
