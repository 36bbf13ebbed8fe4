import json

import pytest

from megatron_lite.arguments import build_parser, parse_args, parse_split
from megatron_lite.config import ConfigError


def test_defaults_give_a_valid_config_with_derived_sizes():
    config, notes = parse_args(["--hidden-size", "128", "--num-attention-heads", "8"], world_size=4)
    assert config.model.ffn_hidden_size == 512
    assert config.model.max_position_embeddings == config.model.seq_length
    assert config.parallel.data_parallel_size == 4
    assert config.batch.global_batch_size == 4 and config.batch.gradient_accumulation_steps == 1
    assert notes == []


def test_config_is_immutable():
    config, _ = parse_args([], world_size=1)
    with pytest.raises(Exception):
        config.model.hidden_size = 3


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


# (argv, world size, message regex): one row per validation rule.
RULES = [
    pytest.param(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
                 r"^world size 6 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4;"
                 r".*Launch a multiple of 4 processes", id="world-size-divisible-by-tp-pp"),
    pytest.param(["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4,
                 r"^--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4; heads are split whole"
                 r".*Use --num-attention-heads 4 or 8", id="heads-divisible-by-tp"),
    pytest.param(["--hidden-size", "100", "--num-attention-heads", "8"], 1,
                 r"^--hidden-size 100 is not divisible by --num-attention-heads 8;.*Use --num-attention-heads 5 or 10",
                 id="hidden-divisible-by-heads"),
    pytest.param(["--ffn-hidden-size", "250", "--tensor-model-parallel-size", "4"], 4,
                 r"^--ffn-hidden-size 250 is not divisible by --tensor-model-parallel-size 4;.*Use --ffn-hidden-size 248 or 252",
                 id="ffn-divisible-by-tp"),
    pytest.param(["--num-layers", "2", "--pipeline-model-parallel-size", "4"], 4,
                 r"^--num-layers 2 is smaller than --pipeline-model-parallel-size 4;.*Use --pipeline-model-parallel-size 2 or less",
                 id="layers-at-least-pp"),
    pytest.param(["--zero-stage", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"], 2,
                 r"^--zero-stage 2 with --pipeline-model-parallel-size 2: pipeline parallelism needs each stage's full "
                 r"gradients for gradient accumulation; use --zero-stage 1, or --pipeline-model-parallel-size 1 for ZeRO 2/3$",
                 id="zero2-with-pp"),
    pytest.param(["--zero-stage", "3", "--pipeline-model-parallel-size", "2", "--num-layers", "4"], 2,
                 r"^--zero-stage 3 with --pipeline-model-parallel-size 2", id="zero3-with-pp"),
    pytest.param(["--bf16", "--fp16"], 1, r"^--bf16 and --fp16 were both given; choose one", id="bf16-and-fp16"),
    pytest.param(["--seq-length", "256", "--max-position-embeddings", "128"], 1,
                 r"^--seq-length 256 is larger than --max-position-embeddings 128;.*Use --max-position-embeddings 256 or more",
                 id="seq-longer-than-positions"),
    pytest.param(["--num-layers", "0"], 1, r"^--num-layers must be at least 1, got 0$", id="layers-below-one"),
    pytest.param(["--hidden-size", "-8"], 1, r"^--hidden-size must be at least 1, got -8$", id="hidden-below-one"),
    pytest.param(["--micro-batch-size", "0"], 1, r"^--micro-batch-size must be at least 1, got 0$", id="micro-below-one"),
    pytest.param(["--tensor-model-parallel-size", "0"], 1, r"^--tensor-model-parallel-size must be at least 1, got 0$",
                 id="tp-below-one"),
    pytest.param(["--save-interval", "100"], 1, r"^--save-interval 100 needs --save DIR", id="save-interval-without-save"),
    pytest.param(["--data-path", "/nonexistent/corpus_text_document", "--vocab-size", "100"], 1,
                 r"^--data-path /nonexistent/corpus_text_document.bin: no such file; give the prefix of a .bin/.idx pair",
                 id="missing-data-path"),
    pytest.param(["--tokenizer-model", "/nonexistent/spm.model"], 1,
                 r"^--tokenizer-model /nonexistent/spm.model: no such file; train one with tools/train_tokenizer.py",
                 id="missing-tokenizer-model"),
    pytest.param(["--tokenizer-type", "SentencePieceTokenizer"], 1,
                 r"^--tokenizer-type SentencePieceTokenizer needs --tokenizer-model", id="sentencepiece-without-model"),
    pytest.param(["--tokenizer-type", "NullTokenizer"], 1, r"^--tokenizer-type NullTokenizer needs --vocab-size N",
                 id="null-tokenizer-without-vocab"),
    pytest.param(["--micro-batch-size", "4", "--global-batch-size", "100"], 8,
                 r"^--global-batch-size 100 is not divisible by --micro-batch-size 4 x data-parallel size 8 = 32; "
                 r"use --global-batch-size 96 or 128$", id="global-batch-divisible"),
    pytest.param(["--min-lr", "1e-3", "--lr", "1e-4"], 1, r"^--min-lr 0.001 must be between 0 and --lr 0.0001",
                 id="min-lr-above-lr"),
    pytest.param(["--lr-warmup-iters", "50", "--train-iters", "20"], 1,
                 r"^--lr-warmup-iters 50 is longer than the decay \(--train-iters 20\); use --lr-warmup-iters 2",
                 id="warmup-longer-than-decay"),
    pytest.param(["--hidden-dropout", "1.0"], 1, r"^--hidden-dropout 1.0 must be in \[0, 1\)", id="dropout-range"),
    pytest.param(["--loss-scale", "128"], 1, r"^--loss-scale 128.0 only applies with --fp16", id="loss-scale-without-fp16"),
    pytest.param(["--cpu-offload"], 1, r"^--cpu-offload needs ZeRO \(--zero-stage 1, 2 or 3\) and "
                 r"--pipeline-model-parallel-size 1", id="offload-without-zero"),
    pytest.param(["--split", "90,x,1"], 1, r"^--split '90,x,1' must be up to three comma-separated numbers", id="split-format"),
    pytest.param(["--data-path", "0.3", "a", "0.7"], 1, r"^--data-path takes one prefix or weight/prefix pairs", id="data-path-pairs"),
    pytest.param(["--pipeline-partition-method", "3,2", "--num-layers", "6", "--pipeline-model-parallel-size", "2"], 2,
                 r"^--pipeline-partition-method 3,2 must list 2 stage layer counts, each >= 1, summing to --num-layers 6; e.g. 3,3",
                 id="partition-counts"),
    pytest.param(["--position-embedding-type", "rope", "--hidden-size", "60", "--num-attention-heads", "4"], 1,
                 r"^--position-embedding-type rope needs an even head dimension", id="rope-even-head-dim"),
    pytest.param(["--clip-grad", "-1"], 1, r"^--clip-grad must be 0 \(off\) or positive", id="clip-grad-negative"),
    pytest.param(["--rampup-batch-size", "3", "4", "100", "--micro-batch-size", "2", "--global-batch-size", "16"], 1,
                 r"^--rampup-batch-size start 3 is not divisible", id="rampup-start"),
]


@pytest.mark.parametrize("argv, world_size, message", RULES)
def test_validation_rule_names_flag_value_and_fix(argv, world_size, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv, world_size=world_size)


def test_unreadable_deepspeed_config_json_is_named(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^--deepspeed-config {bad}: not valid JSON"):
        parse_args(["--deepspeed-config", str(bad)], world_size=1)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        parse_args(["--deepspeed-config", str(bad)], world_size=1)


def test_layers_not_divisible_by_pp_warns_with_per_stage_counts():
    config, notes = parse_args(["--num-layers", "7", "--pipeline-model-parallel-size", "3"], world_size=3)
    assert config.model.num_layers == 7
    assert notes == ["warning: --num-layers 7 is not divisible by --pipeline-model-parallel-size 3; stages get "
                     "unequal layer counts (uniform split: 3, 2, 2), the partitioner balances by cost"]


def test_vocab_is_padded_to_multiple_of_divisor_times_tp_and_logged():
    config, notes = parse_args(["--vocab-size", "50257", "--tensor-model-parallel-size", "2", "--num-attention-heads", "4"],
                               world_size=2)
    assert config.model.padded_vocab_size == 50432  # multiple of 128 x 2 = 256
    assert notes == ["vocabulary 50257 padded to 50432 (multiple of --make-vocab-size-divisible-by 128 x TP 2)"]


def test_readable_data_path_and_weights_are_accepted(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.bin").write_bytes(b"")
        (tmp_path / f"{name}.idx").write_bytes(b"")
    config, _ = parse_args(["--data-path", "0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b"),
                            "--vocab-size", "100"], world_size=1)
    assert config.data.data_path == ("0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b"))


def test_split_is_normalised_and_padded():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))


def test_world_size_comes_from_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    config, _ = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                            "--num-layers", "4"])
    assert config.parallel.data_parallel_size == 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    config, _ = parse_args([])
    assert config.parallel.world_size == 4
