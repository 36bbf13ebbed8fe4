"""Validation rules on the config dataclasses: each rule function called directly, then validate() as a whole."""
import json

import pytest

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation import validate
from megatron_lite.validation.dependent_flags import dependent_flag_rules
from megatron_lite.validation.numbers import number_rules
from megatron_lite.validation.probes import data_rules, deepspeed_rules, tokenizer_rules
from megatron_lite.validation.rules import (
    batch_rules,
    logging_rules,
    model_rules,
    optimizer_rules,
    parallel_rules,
    precision_rules,
    training_rules,
)


def cfg(**fields) -> Config:
    """A Config with `section__field=value` changes, e.g. cfg(model__num_layers=0)."""
    return Config().replace(**fields)


def layout(world, tp=1, pp=1, **fields):
    return cfg(parallel__world_size=world, parallel__tensor_model_parallel_size=tp,
               parallel__pipeline_model_parallel_size=pp, **fields)


def dp(config):
    """What the parallel rule derives, which later rules read."""
    return parallel_rules(config, [])


# (rule, config, message regex): one row per rule.
RULES = [
    pytest.param(parallel_rules, layout(6, 2, 2), r"^world size 6 is not divisible by --tensor-model-parallel-size 2 x "
                 r"--pipeline-model-parallel-size 2 = 4;.*Launch a multiple of 4 processes", id="world-size-divisible-by-tp-pp"),
    pytest.param(number_rules, cfg(parallel__distributed_timeout_minutes=0.0),
                 r"^--distributed-timeout-minutes must be more than 0, got 0; e\.g\. 10$", id="distributed-timeout-positive"),
    pytest.param(parallel_rules, layout(2, 1, 2, model__num_layers=4, parallel__zero_stage=2),
                 r"^--zero-stage 2 with --pipeline-model-parallel-size 2: pipeline parallelism needs each stage's full "
                 r"gradients for gradient accumulation; use --zero-stage 1, or --pipeline-model-parallel-size 1 for ZeRO 2/3$",
                 id="zero2-with-pp"),
    pytest.param(parallel_rules, layout(2, 1, 2, model__num_layers=4, parallel__zero_stage=3),
                 r"^--zero-stage 3 with --pipeline-model-parallel-size 2", id="zero3-with-pp"),
    pytest.param(parallel_rules, layout(1, parallel__cpu_offload=True),
                 r"^--cpu-offload needs ZeRO \(--zero-stage 1, 2 or 3\) and --pipeline-model-parallel-size 1",
                 id="offload-without-zero"),
    pytest.param(number_rules, layout(1, 0), r"^--tensor-model-parallel-size must be at least 1, got 0; e\.g\. 1$", id="tp-below-one"),
    pytest.param(parallel_rules, layout(2, 1, 2, model__num_layers=6, parallel__pipeline_partition_method="3,2"),
                 r"^--pipeline-partition-method 3,2 must list 2 stage layer counts, each >= 1, summing to --num-layers 6; "
                 r"e.g. 3,3", id="partition-counts"),
    pytest.param(parallel_rules, layout(1, parallel__pipeline_partition_method="fastest"),
                 r"^--pipeline-partition-method 'fastest' is not one of cost, profile, uniform, parameters", id="partition-name"),
    pytest.param(model_rules, layout(4, 4, model__num_attention_heads=6, model__hidden_size=96),
                 r"^--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4; heads are split whole"
                 r".*Use --num-attention-heads 4 or 8", id="heads-divisible-by-tp"),
    pytest.param(model_rules, layout(1, model__hidden_size=100, model__num_attention_heads=8),
                 r"^--hidden-size 100 is not divisible by --num-attention-heads 8;.*Use --num-attention-heads 5 or 10",
                 id="hidden-divisible-by-heads"),
    pytest.param(model_rules, layout(4, 4, model__ffn_hidden_size=250),
                 r"^--ffn-hidden-size 250 is not divisible by --tensor-model-parallel-size 4;.*Use --ffn-hidden-size 248 or 252",
                 id="ffn-divisible-by-tp"),
    pytest.param(model_rules, layout(4, 1, 4, model__num_layers=2),
                 r"^--num-layers 2 is smaller than --pipeline-model-parallel-size 4;.*Use --pipeline-model-parallel-size 2 or less",
                 id="layers-at-least-pp"),
    pytest.param(model_rules, layout(1, model__seq_length=256, model__max_position_embeddings=128),
                 r"^--seq-length 256 is larger than --max-position-embeddings 128;.*Use --max-position-embeddings 256 or more",
                 id="seq-longer-than-positions"),
    pytest.param(number_rules, layout(1, model__num_layers=0), r"^--num-layers must be at least 1, got 0; e\.g\. 2$", id="layers-below-one"),
    pytest.param(number_rules, layout(1, model__hidden_size=-8), r"^--hidden-size must be at least 1, got -8; e\.g\. 64$",
                 id="hidden-below-one"),
    pytest.param(model_rules, cfg(model__window_size=(0, 0)), r"^--window-size 0,0: L, the earlier tokens a token "
                 r"sees, must be 1 or more; e\.g\. --window-size 127,0", id="window-empty"),
    pytest.param(model_rules, cfg(model__window_size=(8, 2)), r"^--window-size 8,2: R, the later tokens a token sees, "
                 r"must be 0 in causal training; use --window-size 8,0$", id="window-looks-ahead"),
    pytest.param(dependent_flag_rules, cfg(model__window_attn_skip_freq=2), r"^--window-attn-skip-freq 2 chooses "
                 r"the global layers among windowed ones; add --window-size L", id="skip-freq-without-window"),
    pytest.param(number_rules, layout(1, model__hidden_dropout=1.0), r"^--hidden-dropout must be less than 1, got 1; e\.g\. 0\.1$",
                 id="dropout-range"),
    pytest.param(model_rules, layout(1, model__position_embedding_type="rope", model__hidden_size=60,
                                     model__num_attention_heads=4),
                 r"^--position-embedding-type rope needs an even head dimension \(RoPE turns pairs of it\); "
                 r"--hidden-size 60 / --num-attention-heads 4 = 15\. Use --kv-channels 16$", id="rope-even-head-dim"),
    pytest.param(model_rules, layout(1, model__position_embedding_type="rope", model__kv_channels=23),
                 r"^--position-embedding-type rope needs an even head dimension \(RoPE turns pairs of it\); "
                 r"--kv-channels 23\. Use --kv-channels 24$", id="rope-even-kv-channels"),
    pytest.param(number_rules, layout(1, model__kv_channels=0), r"^--kv-channels must be at least 1, got 0; e\.g\. 1$",
                 id="kv-channels-below-one"),
    pytest.param(model_rules, layout(2, 2, model__qk_layernorm=True, parallel__zero_stage=2),
                 r"^--qk-layernorm at --tensor-model-parallel-size 2 with --zero-stage 2: the QK-norm gradients, each "
                 r"TP rank's over its own heads, are summed over TP once per step in the pipeline engine, which ZeRO "
                 r"2/3 do not use; use --zero-stage 1 \(or 0\), or --tensor-model-parallel-size 1$",
                 id="qk-layernorm-tp-with-zero2"),
    pytest.param(model_rules, layout(8, 8, model__hidden_size=64, model__num_attention_heads=8, model__kv_channels=6,
                                     model__group_query_attention=True, model__num_query_groups=1),
                 r"^--num-query-groups 1 at --tensor-model-parallel-size 8: each group's key/value rows "
                 r"\(6 per group\) are kept in 8 pieces, .* a head dimension \(--kv-channels\) divisible by 8",
                 id="shared-group-rows-vs-kv-channels"),
    pytest.param(batch_rules, dp(layout(1, batch__micro_batch_size=0)), r"^--micro-batch-size must be at least 1, got 0$",
                 id="micro-below-one"),
    pytest.param(batch_rules, dp(layout(8, batch__micro_batch_size=4, batch__global_batch_size=100)),
                 r"^--global-batch-size 100 is not divisible by --micro-batch-size 4 x data-parallel size 8 = 32; "
                 r"use --global-batch-size 96 or 128$", id="global-batch-divisible"),
    pytest.param(batch_rules, dp(layout(1, batch__micro_batch_size=2, batch__global_batch_size=16,
                                        batch__rampup_batch_size=(3, 4, 100))),
                 r"^--rampup-batch-size start 3 is not divisible", id="rampup-start"),
    pytest.param(optimizer_rules, cfg(optimizer__min_lr=1e-3, optimizer__lr=1e-4),
                 r"^--min-lr 0.001 must be between 0 and --lr 0.0001", id="min-lr-above-lr"),
    pytest.param(optimizer_rules, cfg(optimizer__lr_warmup_iters=50, training__train_iters=20),
                 r"^--lr-warmup-iters 50 is longer than the decay \(--train-iters 20\); use --lr-warmup-iters 2",
                 id="warmup-longer-than-decay"),
    pytest.param(number_rules, cfg(optimizer__clip_grad=-1), r"^--clip-grad must be at least 0, got -1; e\.g\. 1$",
                 id="clip-grad-negative"),
    pytest.param(precision_rules, cfg(precision__bf16=True, precision__fp16=True),
                 r"^--bf16 and --fp16 were both given; choose one", id="bf16-and-fp16"),
    pytest.param(precision_rules, cfg(precision__loss_scale=128.0), r"^--loss-scale 128.0 only applies with --fp16",
                 id="loss-scale-without-fp16"),
    pytest.param(training_rules, cfg(training__save_interval=100), r"^--save-interval 100 needs --save DIR",
                 id="save-interval-without-save"),
    pytest.param(number_rules, cfg(training__eval_iters=-1), r"^--eval-iters must be at least 0, got -1; e\.g\. 10$",
                 id="eval-iters-negative"),
    pytest.param(data_rules, cfg(data__data_path=((1.0, "/nonexistent/corpus_text_document"),)),
                 r"^--data-path /nonexistent/corpus_text_document.bin: no such file; give the prefix of a .bin/.idx pair",
                 id="missing-data-path"),
    pytest.param(data_rules, cfg(data__data_path=((-0.3, "a"), (0.7, "b"))),
                 r"^--data-path weight -0.3 for 'a' must be a positive finite number", id="data-path-weight"),
    pytest.param(data_rules, cfg(data__split=(0.0, 0.0, 0.0)),
                 r"^--split '0,0,0' must be up to three non-negative numbers with a positive sum", id="split-sum"),
    pytest.param(tokenizer_rules, cfg(data__tokenizer_model="/nonexistent/spm.model"),
                 r"^--tokenizer-model /nonexistent/spm.model: no such file; train one with tools/train_tokenizer.py",
                 id="missing-tokenizer-model"),
    pytest.param(tokenizer_rules, cfg(data__tokenizer_type="SentencePieceTokenizer"),
                 r"^--tokenizer-type SentencePieceTokenizer needs --tokenizer-model", id="sentencepiece-without-model"),
    pytest.param(tokenizer_rules, cfg(data__tokenizer_type="NullTokenizer"),
                 r"^--tokenizer-type NullTokenizer needs --vocab-size N", id="null-tokenizer-without-vocab"),
    pytest.param(logging_rules, cfg(logging__log_level="loud"),
                 r"^--log-level loud is not one of debug, info, warning, error$", id="log-level"),
    pytest.param(model_rules, layout(1, parallel__sequence_parallel=True),
                 r"^--sequence-parallel splits the sequence across the tensor-parallel ranks and needs "
                 r"--tensor-model-parallel-size 2 or more; got 1. Use --tensor-model-parallel-size 2", id="sp-at-tp1"),
    pytest.param(model_rules, layout(4, 4, model__seq_length=30, parallel__sequence_parallel=True),
                 r"^--seq-length 30 is not divisible by --tensor-model-parallel-size 4: --sequence-parallel gives each "
                 r"TP rank seq-length / TP positions. Use --seq-length 28 or 32$", id="sp-seq-divisible-by-tp"),
    pytest.param(model_rules, layout(2, 2, parallel__sequence_parallel=True, parallel__zero_stage=2),
                 r"^--sequence-parallel with --zero-stage 2: .* use --zero-stage 1 \(or 0\)$", id="sp-with-zero2"),
    pytest.param(model_rules, cfg(model__recompute_granularity="full"),
                 r"^--recompute-granularity full needs --recompute-method \(uniform or block\) and "
                 r"--recompute-num-layers N, as in Megatron-LM; e.g. --recompute-method uniform "
                 r"--recompute-num-layers 1",
                 id="full-recompute-needs-method"),
    pytest.param(model_rules, cfg(model__recompute_granularity="full", model__recompute_method="block",
                                  model__recompute_num_layers=3),
                 r"^--recompute-num-layers 3 must be between 1 and --num-layers 2, e.g. 1$", id="recompute-num-layers"),
    pytest.param(model_rules, cfg(model__recompute_granularity="selective", model__recompute_method="uniform"),
                 r"^--recompute-method uniform applies only with --recompute-granularity full; add "
                 r"--recompute-granularity full or drop --recompute-method$", id="method-without-full"),
    pytest.param(model_rules, cfg(model__recompute_activations=True, model__recompute_granularity="full",
                                  model__recompute_method="uniform", model__recompute_num_layers=1),
                 r"^--recompute-activations means --recompute-granularity selective \(as in Megatron-LM\); it "
                 r"contradicts --recompute-granularity full", id="recompute-activations-vs-full"),
    pytest.param(model_rules, cfg(model__group_query_attention=True, model__num_query_groups=3),
                 r"^--num-query-groups 3 does not divide --num-attention-heads 4; every group serves the same number "
                 r"of query heads. Use --num-query-groups 2 or 4$", id="groups-not-dividing-heads"),
    pytest.param(model_rules, layout(4, 4, model__hidden_size=96, model__num_attention_heads=12,
                                     model__group_query_attention=True, model__num_query_groups=6),
                 r"^--num-query-groups 6 neither divides nor is divided by --tensor-model-parallel-size 4: each TP "
                 r"rank needs whole groups, or one group shared by TP/groups ranks. Use --num-query-groups 2 or 4$",
                 id="groups-vs-tp"),
    pytest.param(model_rules, layout(8, 8, model__hidden_size=32, model__num_attention_heads=8,
                                     model__group_query_attention=True, model__num_query_groups=1),
                 r"^--num-query-groups 1 at --tensor-model-parallel-size 8: each group's key/value rows \(4 per group\) "
                 r"are kept in 8 pieces", id="shared-group-rows-vs-tp"),
    pytest.param(model_rules, cfg(model__num_query_groups=2),
                 r"^--num-query-groups 2 needs --group-query-attention; add it", id="groups-without-gqa"),
    pytest.param(model_rules, cfg(model__group_query_attention=True),
                 r"^--group-query-attention needs --num-query-groups N", id="gqa-without-groups"),
    pytest.param(model_rules, layout(4, 4, model__swiglu=True, model__ffn_hidden_size=90),
                 r"^--ffn-hidden-size 90 is not divisible by --tensor-model-parallel-size 4; the MLP is split "
                 r"column-wise across TP ranks \(with --swiglu, both the gate and the up projection\). Use "
                 r"--ffn-hidden-size 88 or 92$", id="swiglu-ffn-vs-tp"),
    pytest.param(model_rules, cfg(model__swiglu=True, model__quick_geglu=True),
                 r"^--swiglu and --quick-geglu each choose the gated MLP's activation .*; drop one of them$",
                 id="swiglu-with-quick-geglu"),
    pytest.param(model_rules, cfg(model__openai_gelu=True, model__quick_geglu=True),
                 r"^--openai-gelu chooses GeLU's approximation, but --quick-geglu gates with quick-GeLU and has no "
                 r"GeLU; drop one of them$", id="openai-gelu-with-quick-geglu"),
    pytest.param(model_rules, cfg(model__openai_gelu=True, model__swiglu=True),
                 r"^--openai-gelu chooses GeLU's approximation, but --swiglu gates with SiLU",
                 id="openai-gelu-with-swiglu"),
    pytest.param(model_rules, cfg(model__glu_linear_offset=1.0),
                 r"^--glu-linear-offset 1 is added to a gated MLP's up half, but this MLP is not gated \(GeLU\); add "
                 r"--quick-geglu \(gpt-oss: --glu-linear-offset 1\) or --swiglu, or drop --glu-linear-offset$",
                 id="glu-offset-without-gated-mlp"),
    pytest.param(model_rules, cfg(model__activation_func_clamp_value=7.0),
                 r"^--activation-func-clamp-value 7 clamps a gated MLP's gate and up halves, but this MLP is not gated "
                 r"\(GeLU\); add --quick-geglu .* or --swiglu, or drop --activation-func-clamp-value$",
                 id="clamp-without-gated-mlp"),
    pytest.param(model_rules, layout(4, 4, model__quick_geglu=True, model__ffn_hidden_size=90),
                 r"^--ffn-hidden-size 90 is not divisible by --tensor-model-parallel-size 4; the MLP is split "
                 r"column-wise across TP ranks \(with --quick-geglu, both the gate and the up projection\)",
                 id="quick-geglu-ffn-vs-tp"),
    pytest.param(model_rules, cfg(model__use_rope_scaling=True),
                 r"^--use-rope-scaling scales rotary frequencies and needs --position-embedding-type rope",
                 id="rope-scaling-without-rope"),
    pytest.param(parallel_rules, layout(6, 1, 1, parallel__context_parallel_size=4),
                 r"^world size 6 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 4 x "
                 r"--pipeline-model-parallel-size 1 = 4;", id="world-size-divisible-by-tp-cp-pp"),
    pytest.param(parallel_rules, cfg(parallel__cp_comm_type="p2p", parallel__context_parallel_size=2,
                                     parallel__world_size=2),
                 r"^--cp-comm-type p2p: ring attention \(p2p\) is not built here; use --cp-comm-type a2a",
                 id="cp-ring-attention"),
    pytest.param(model_rules, layout(4, 2, parallel__context_parallel_size=2, model__hidden_size=96,
                                     model__num_attention_heads=6),
                 r"^--num-attention-heads 6 / --tensor-model-parallel-size 2 = 3 heads per TP rank is not divisible "
                 r"by --context-parallel-size 2: .* Use --context-parallel-size 1$", id="heads-vs-cp"),
    pytest.param(model_rules, layout(4, 1, parallel__context_parallel_size=4, model__group_query_attention=True,
                                     model__num_query_groups=6, model__hidden_size=96, model__num_attention_heads=12),
                 r"^--num-query-groups 6 at --tensor-model-parallel-size 1 leaves 6 key/value groups per TP rank, "
                 r"which neither divides nor is divided by --context-parallel-size 4", id="groups-vs-cp"),
    pytest.param(model_rules, layout(4, 2, parallel__context_parallel_size=2, parallel__sequence_parallel=True,
                                     model__seq_length=1026),
                 r"^--seq-length 1026 is not divisible by --context-parallel-size 2 x --tensor-model-parallel-size 2 "
                 r"\(with --sequence-parallel\) = 4: .* Use --seq-length 1024 or 1028$", id="seq-vs-cp-sp"),
]


def test_kv_channels_frees_the_head_width_from_hidden_over_heads():
    """Hidden 100 over 8 heads is refused without a head width and taken with one; the width is --kv-channels
    wherever the model asks for it, hidden / heads when not given."""
    with pytest.raises(ConfigError, match=r"--hidden-size 100 is not divisible by --num-attention-heads 8.*or give the "
                                          r"head width with --kv-channels$"):
        model_rules(layout(1, model__hidden_size=100, model__num_attention_heads=8), [])
    config, _ = validate(layout(1, model__hidden_size=100, model__num_attention_heads=8, model__kv_channels=16,
                                model__position_embedding_type="rope", model__qk_layernorm=True))
    assert config.model.head_dim == 16 and config.model.kv_channels == 16
    assert validate(layout(1))[0].model.head_dim == 64 // 4
    # QK-norm at TP 2 trains under ZeRO 0 and 1 (the pipeline engine sums its gradients), and at TP 1 under ZeRO 2
    for tp, zero in ((2, 1), (1, 2)):
        validate(layout(2, tp, model__qk_layernorm=True, parallel__zero_stage=zero))


def test_swiglu_takes_megatron_lms_default_ffn_width():
    from megatron_lite.validation.rules import default_ffn_hidden_size

    assert default_ffn_hidden_size(4096, gated=True) == 10880  # int(4 x 4096 x 2/3 / 64) x 64, as Megatron-LM
    assert default_ffn_hidden_size(4096, gated=False) == 16384


def test_gpt_oss_activation_flags_validate_and_need_a_gated_mlp():
    """gpt-oss's MLP (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7) and SwiGLU with the same
    options pass; the gated width is the default there too."""
    for unit in ("quick_geglu", "swiglu"):
        config, notes = validate(layout(1, **{f"model__{unit}": True}, model__glu_linear_offset=1.0,
                                        model__activation_func_clamp_value=7.0))
        assert config.model.gated_linear_unit and config.model.ffn_hidden_size == 128 and notes == []


@pytest.mark.parametrize("rule, config, message", RULES)
def test_each_rule_names_the_flag_the_value_and_a_fix(rule, config, message):
    with pytest.raises(ConfigError, match=message):
        rule(config, [])


def test_a_default_config_validates_and_gets_its_derived_fields():
    config, notes = validate(layout(4, model__hidden_size=128, model__num_attention_heads=8))
    assert config.model.ffn_hidden_size == 512
    assert config.model.max_position_embeddings == config.model.seq_length
    assert config.parallel.data_parallel_size == 4
    assert (config.batch.micro_batch_size, config.batch.global_batch_size, config.batch.gradient_accumulation_steps) \
        == (1, 4, 1)
    assert config.optimizer.lr_decay_iters == config.training.train_iters
    assert notes == []


def test_independent_problems_are_reported_together():
    bad = layout(6, 2, 2, precision__bf16=True, precision__fp16=True, optimizer__lr=-1.0,
                 training__save_interval=10)
    with pytest.raises(ConfigError) as error:
        validate(bad)
    text = str(error.value)
    assert text.startswith("4 problems:\n  1. --lr must be more than 0")  # numbers are checked first
    for part in ("world size 6 is not divisible", "--save-interval 10 needs --save DIR", "--lr must be more than 0, got -1", "--bf16 and --fp16 were both given"):
        assert part in text
    # the batch and model rules need the DP size, which the broken layout does not give: not reported twice
    assert text.count("\n  ") == 4


def test_layers_not_divisible_by_pp_warns_with_per_stage_counts():
    notes = []
    model_rules(layout(3, 1, 3, model__num_layers=7), notes)
    assert notes == ["warning: --num-layers 7 is not divisible by --pipeline-model-parallel-size 3; stages get "
                     "unequal layer counts (uniform split: 3, 2, 2), the partitioner balances by cost"]


def test_vocab_is_padded_to_multiple_of_divisor_times_tp_and_logged():
    notes = []
    config = tokenizer_rules(layout(2, 2, model__vocab_size=50257), notes)
    assert config.data.tokenizer_type == "NullTokenizer"
    assert config.model.padded_vocab_size == 50432  # multiple of 128 x 2 = 256
    assert notes == ["vocabulary 50257 padded to 50432 (multiple of --make-vocab-size-divisible-by 128 x TP 2)"]


def test_the_sentencepiece_model_decides_the_vocabulary(spm_model):
    path, size = spm_model
    config = tokenizer_rules(cfg(data__tokenizer_model=path), [])
    assert config.data.tokenizer_type == "SentencePieceTokenizer"
    assert config.model.vocab_size == size and config.model.padded_vocab_size == 128 * -(-size // 128)


def test_vocab_size_that_disagrees_with_the_sentencepiece_model_is_refused(spm_model):
    path, size = spm_model
    with pytest.raises(ConfigError, match=rf"^--vocab-size {size + 7} disagrees with --tokenizer-model {path}, which "
                                          rf"has {size} pieces; .* drop --vocab-size \(or use --vocab-size {size}\)"):
        tokenizer_rules(cfg(data__tokenizer_model=path, model__vocab_size=size + 7), [])


def test_a_split_that_leaves_no_training_documents_is_refused_with_the_file(dataset_prefix):
    config = validate(cfg(model__vocab_size=100))[0]
    with pytest.raises(ConfigError, match=rf"^--split 0,1,0 leaves no training documents in {dataset_prefix}; give the "
                                          r"first weight a positive share"):
        data_rules(config.replace(data__data_path=((1.0, dataset_prefix),), data__split=(0.0, 1.0, 0.0)), [])


def test_a_truncated_index_is_refused_naming_the_file(dataset_prefix, tmp_path):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copy(dataset_prefix + ".bin", broken + ".bin")
    with open(dataset_prefix + ".idx", "rb") as f:
        (tmp_path / "broken.idx").write_bytes(f.read()[:-8])
    config = validate(cfg(model__vocab_size=100))[0]
    with pytest.raises(ConfigError, match=rf"^--data-path: {broken}.idx: .* bytes, but a header of"):
        data_rules(config.replace(data__data_path=((1.0, broken),)), [])


def test_deepspeed_json_is_read_once_and_contradictions_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 3, "comms_logger": {"enabled": True}}))
    config = validate(cfg())[0].replace(training__deepspeed_config=str(path))
    with pytest.raises(ConfigError, match=r'"gradient_accumulation_steps" is 3 but the command-line flags give 1'):
        deepspeed_rules(config, [])
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^--deepspeed-config {path}: not JSON"):
        deepspeed_rules(config, [])
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        deepspeed_rules(config, [])


def test_config_round_trips_through_a_dict():
    config = validate(cfg(data__data_path=(), model__vocab_size=64, batch__rampup_batch_size=(1, 1, 10),
                          batch__global_batch_size=4))[0]
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_config_is_immutable():
    with pytest.raises(Exception):
        Config().model.hidden_size = 3


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    text = root / "text.txt"
    text.write_text("\n".join(f"line {i} of a small corpus about validation, vocabularies, tokenizers and quick brown foxes jumping" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(root / "m"), vocab_size=50,
                                             minloglevel=2)
    return str(root / "m.model"), 50


@pytest.fixture(scope="module")
def dataset_prefix(tmp_path_factory):
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path_factory.mktemp("data") / "tiny_text_document")
    import numpy as np

    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i in range(10):
            writer.add_document(list(range(i, i + 20)))
    return prefix


def test_fp16_at_zero0_is_refused_with_what_works():
    with pytest.raises(ConfigError, match=r"^--fp16 with --zero-stage 0: .* use --zero-stage 1 with --fp16, or --bf16"):
        precision_rules(cfg(precision__fp16=True), [])
    precision_rules(cfg(precision__fp16=True, parallel__zero_stage=1), [])


def test_recompute_activations_means_selective_as_in_megatron_and_says_what_it_did_before():
    notes = []
    config = model_rules(cfg(model__recompute_activations=True), notes)
    assert config.model.recompute_granularity == "selective"
    assert any("before this version it recomputed whole layers, which is now --recompute-granularity full "
               "--recompute-method uniform --recompute-num-layers 1" in n for n in notes)


def test_a_resume_that_changes_the_window_is_refused_and_one_that_changes_document_masking_is_not():
    from megatron_lite.validation.resume import resume_differences

    saved = Config.from_dict(cfg(model__window_size=(127, 0), model__window_attn_skip_freq=2).to_dict())  # as read
    assert resume_differences(saved, cfg(model__window_size=(127, 0), model__window_attn_skip_freq=2,
                                         model__reset_attention_mask=True, model__reset_position_ids=True)) == []
    problems = resume_differences(saved, cfg(model__window_size=(63, 0)))
    assert any(p.startswith("--window-size: checkpoint") for p in problems), problems
    assert any(p.startswith("--window-attn-skip-freq: checkpoint 2") for p in problems), problems


def test_a_resume_that_adds_or_drops_the_qkv_bias_is_refused_and_a_flag_that_changes_nothing_is_not():
    from megatron_lite.validation.resume import resume_differences

    no_biases = cfg(model__add_bias_linear=False)
    qwen2 = Config.from_dict(cfg(model__add_bias_linear=False, model__add_qkv_bias=True).to_dict())  # as read
    assert resume_differences(qwen2, no_biases) == [
        "a bias in the QKV linear (--add-qkv-bias, or biases in every linear layer): checkpoint on, this run off"]
    added = resume_differences(Config.from_dict(no_biases.to_dict()), qwen2)
    assert len(added) == 1 and added[0].endswith("checkpoint off, this run on")
    # With biases in every linear layer the QKV linear has one either way: the same model.
    assert resume_differences(Config.from_dict(cfg().to_dict()), cfg(model__add_qkv_bias=True)) == []


DUALPIPEV_BASE = ["--pipeline-schedule", "dualpipev", "--num-layers", "4", "--micro-batch-size", "1"]


@pytest.mark.parametrize("argv, world, message", [
    (["--global-batch-size", "8"], 1,
     r"^--pipeline-schedule dualpipev runs two stages on each of at least 2 pipeline ranks, got "
     r"--pipeline-model-parallel-size 1; use --pipeline-model-parallel-size 2 or more, or --pipeline-schedule 1f1b$"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], 4,
     r"^--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size 2 = 4 micro-batches per step "
     r"\(DeepSpeed's DualPipeVEngine\), got gradient accumulation steps 2 \(global batch 4 / \(micro batch 1 x "
     r"data-parallel size 2\)\); use --global-batch-size of 8 or more, or --pipeline-schedule 1f1b$"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "100"], 2,
     r"got --rampup-batch-size starts at 2 samples: gradient accumulation steps 2 .* use a --rampup-batch-size start "
     r"of 4 or more"),
    (["--pipeline-model-parallel-size", "4", "--global-batch-size", "8"], 4,
     r"^--pipeline-schedule dualpipev cuts the layers into 2 x --pipeline-model-parallel-size 4 = 8 stages, each with "
     r"a transformer layer, but --num-layers is 4; use --pipeline-model-parallel-size 2 or less"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-partition-method", "2,2"], 2,
     r"^--pipeline-partition-method 2,2 must list 4 stage layer counts, each >= 1, summing to --num-layers 4; "
     r"e\.g\. 1,1,1,1$"),
], ids=["pp1", "gas-below-2pp", "rampup-start-below-2pp", "layers-below-2pp", "layer-counts-list-2pp-stages"])
def test_dualpipev_is_refused_where_deepspeeds_engine_would_assert(argv, world, message):
    from megatron_lite.arguments import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(DUALPIPEV_BASE + argv, world_size=world)


def test_dualpipev_turns_deepspeeds_partitioned_sends_off_at_tp2_and_a_json_turning_them_on_is_refused(tmp_path):
    from megatron_lite.arguments import parse_args
    from megatron_lite.deepspeed_config import deepspeed_config, sends_partitioned

    argv = DUALPIPEV_BASE + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--global-batch-size", "4"]
    config = parse_args(argv, world_size=4)[0]
    assert deepspeed_config(config)["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert not sends_partitioned(config)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"pipeline": {"pipe_partitioned": True}}))
    with pytest.raises(ConfigError, match=r'"pipeline\.pipe_partitioned" is true but the command-line flags give '
                                          r"false"):
        parse_args(argv + ["--deepspeed-config", str(ds)], world_size=4)
