"""Command-line flags (Megatron-LM names) -> one validated, immutable `Config`.

Every cross-field rule lives in `validate()` and runs before any process group
exists, so a bad combination costs the user one clear line instead of a
traceback from inside torch.distributed or DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple

from megatron_lite import batching
from megatron_lite.config import (
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
    pad_vocab_size,
    vocab_padding_note,
)

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT with tensor, pipeline and data parallelism (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x --hidden-size")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for --tokenizer-type NullTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=True)

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    g.add_argument("--pipeline-partition-method", default="cost",
                   help="cost (default), uniform, parameters, type:<regex>, or layer counts per stage like 3,3,2")
    g.add_argument("--cpu-offload", action="store_true", help="ZeRO optimizer-state offload to CPU (PP = 1 only)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="passed by the deepspeed launcher; LOCAL_RANK from the environment is what is used")

    g = parser.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--gradient-accumulation-steps", type=int, default=None)
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))

    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = parser.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="a dataset prefix, or weights and prefixes: 0.3 prefixA 0.7 prefixB")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=1)
    g.add_argument("--eod-mask-loss", action="store_true")

    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deepspeed-config", default=None, help="extra DeepSpeed JSON merged under ours")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    return parser


def world_size_from_environment() -> int:
    """World size as the launcher sets it: torchrun / deepspeed (WORLD_SIZE) or plain srun (SLURM_NTASKS)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def parse_data_path(values: Optional[Sequence[str]]) -> Tuple[Tuple[float, str], ...]:
    """`prefix` -> ((1.0, prefix),); `w1 p1 w2 p2` -> ((w1, p1), (w2, p2))."""
    if not values:
        return ()
    if len(values) == 1:
        return ((1.0, values[0]),)
    if len(values) % 2:
        raise ConfigError(
            f"--data-path takes one prefix or weight/prefix pairs like '0.3 prefixA 0.7 prefixB'; "
            f"got {len(values)} values: {' '.join(values)}"
        )
    pairs = []
    for weight, prefix in zip(values[0::2], values[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path weight '{weight}' (before '{prefix}') is not a number") from None
        if w <= 0:
            raise ConfigError(f"--data-path weight {weight} for '{prefix}' must be positive")
        pairs.append((w, prefix))
    return tuple(pairs)


def parse_split(split: str) -> Tuple[float, float, float]:
    """Megatron-style '969,30,1' -> normalised (train, valid, test); missing parts are 0."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split '{split}' must be up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split '{split}' must be up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)


def _check_readable_file(path: str, flag: str, hint: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file; {hint}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: file is not readable (permissions); {hint}")


def layers_per_stage_uniform(num_layers: int, stages: int) -> List[int]:
    """Transformer layers per stage when split as evenly as possible (earlier stages take the extra)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def validate(args: argparse.Namespace, world_size: int) -> Tuple[Config, List[str]]:
    """Check every rule and build the Config. Returns (config, notes to print on rank 0)."""
    notes: List[str] = []
    _positive(args, (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
        "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by",
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "train_iters",
        "eval_interval", "log_interval", "save_interval", "keep_last", "exit_interval",
        "loss_scale_window", "hysteresis",
    ))
    if world_size < 1:
        raise ConfigError(f"world size {world_size} (WORLD_SIZE / SLURM_NTASKS) must be at least 1")
    for flag, value in (("--eval-iters", args.eval_iters), ("--lr-warmup-iters", args.lr_warmup_iters),
                        ("--num-workers", args.num_workers)):
        if value < 0:
            raise ConfigError(f"{flag} must be 0 or more, got {value}")

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        fits = [f"{t}x{p}" for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if world_size % (t * p) == 0 and t * p > 1][:4]
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; the data-parallel size must be a whole number. "
            f"Launch a multiple of {tp * pp} processes, or use TP x PP that divides {world_size}"
            + (f" (e.g. {', '.join(fits)})" if fits else "")
        )
    dp = world_size // (tp * pp)

    hidden, heads = args.hidden_size, args.num_attention_heads
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * hidden
    if hidden % heads:
        divisors = [h for h in range(1, hidden + 1) if hidden % h == 0 and h % tp == 0]
        near = sorted(divisors, key=lambda h: abs(h - heads))[:2]
        raise ConfigError(
            f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}; every head needs "
            f"the same width. Use --num-attention-heads {batching.or_join(sorted(near))}"
        )
    if heads % tp:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; heads are "
            f"split whole across TP ranks. Use --num-attention-heads {batching.or_join(batching.nearest_multiples(heads, tp))} "
            f"or a TP size that divides {heads}"
        )
    if ffn % tp:
        raise ConfigError(
            f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}; the MLP is split "
            f"column-wise across TP ranks. Use --ffn-hidden-size {batching.or_join(batching.nearest_multiples(ffn, tp))}"
        )
    if args.position_embedding_type == "rope" and (hidden // heads) % 2:
        raise ConfigError(
            f"--position-embedding-type rope needs an even head dimension; --hidden-size {hidden} / "
            f"--num-attention-heads {heads} = {hidden // heads}"
        )

    max_pos = args.max_position_embeddings if args.max_position_embeddings is not None else args.seq_length
    if args.seq_length > max_pos:
        raise ConfigError(
            f"--seq-length {args.seq_length} is larger than --max-position-embeddings {max_pos}; positions past "
            f"the table have no embedding. Use --max-position-embeddings {args.seq_length} or more"
        )

    if args.num_layers < pp:
        raise ConfigError(
            f"--num-layers {args.num_layers} is smaller than --pipeline-model-parallel-size {pp}; every stage "
            f"needs at least one transformer layer. Use --pipeline-model-parallel-size {args.num_layers} or less"
        )
    if args.num_layers % pp:
        counts = layers_per_stage_uniform(args.num_layers, pp)
        notes.append(
            f"warning: --num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
            f"stages get unequal layer counts (uniform split: {', '.join(map(str, counts))}), "
            f"the partitioner balances by cost"
        )
    _check_partition_method(args.pipeline_partition_method, args.num_layers, pp)

    if args.zero_stage >= 2 and pp > 1:
        raise ConfigError(
            f"--zero-stage {args.zero_stage} with --pipeline-model-parallel-size {pp}: pipeline parallelism "
            f"needs each stage's full gradients for gradient accumulation; use --zero-stage 1, or "
            f"--pipeline-model-parallel-size 1 for ZeRO 2/3"
        )
    if args.cpu_offload and (pp > 1 or args.zero_stage == 0):
        raise ConfigError(
            f"--cpu-offload needs ZeRO (--zero-stage 1, 2 or 3) and --pipeline-model-parallel-size 1; "
            f"got --zero-stage {args.zero_stage}, --pipeline-model-parallel-size {pp}"
        )

    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 were both given; choose one (bf16 needs no loss scaling)")
    if args.loss_scale is not None and not args.fp16:
        raise ConfigError(f"--loss-scale {args.loss_scale} only applies with --fp16; drop it or add --fp16")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ConfigError(f"--loss-scale must be positive, got {args.loss_scale}; omit it for dynamic scaling")
    if args.initial_loss_scale <= 0 or args.min_loss_scale <= 0:
        raise ConfigError("--initial-loss-scale and --min-loss-scale must be positive, e.g. 4294967296 and 1")

    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} {value} must be in [0, 1), e.g. 0.1")

    if args.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if args.min_lr < 0 or args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_decay_iters is not None and args.lr_decay_iters < 1:
        raise ConfigError(f"--lr-decay-iters must be at least 1, got {args.lr_decay_iters}")
    if args.lr_warmup_iters > decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} is longer than the decay "
            f"({'--lr-decay-iters' if args.lr_decay_iters is not None else '--train-iters'} {decay_iters}); "
            f"use --lr-warmup-iters {max(decay_iters // 10, 0)}"
        )
    if args.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be 0 (off) or positive, got {args.clip_grad}")
    if args.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be 0 or positive, got {args.weight_decay}")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise ConfigError(f"--adam-beta1 {args.adam_beta1} and --adam-beta2 {args.adam_beta2} must be in [0, 1)")

    if args.save_interval is not None and not args.save:
        raise ConfigError(f"--save-interval {args.save_interval} needs --save DIR to say where checkpoints go")
    if args.keep_last is not None and not args.save:
        raise ConfigError(f"--keep-last {args.keep_last} needs --save DIR")
    if args.exit_interval is not None and not args.save:
        notes.append("warning: --exit-interval without --save exits without a checkpoint")

    data_path = parse_data_path(args.data_path)
    for _, prefix in data_path:
        for suffix in (".bin", ".idx"):
            _check_readable_file(prefix + suffix, "--data-path",
                                 "give the prefix of a .bin/.idx pair written by tools/preprocess_data.py "
                                 "(e.g. data/corpus_text_document)")
    parse_split(args.split)

    tokenizer_type = args.tokenizer_type
    if tokenizer_type == "GPTSentencePieceTokenizer":
        tokenizer_type = "SentencePieceTokenizer"
    if args.tokenizer_model is not None:
        _check_readable_file(args.tokenizer_model, "--tokenizer-model",
                             "train one with tools/train_tokenizer.py or point at an existing .model file")
        if tokenizer_type is None:
            tokenizer_type = "SentencePieceTokenizer"
    if tokenizer_type is None and args.vocab_size is not None:
        tokenizer_type = "NullTokenizer"
    if tokenizer_type == "SentencePieceTokenizer" and args.tokenizer_model is None:
        raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model PATH.model")
    if tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N")
    if data_path and tokenizer_type is None and args.vocab_size is None:
        raise ConfigError(
            "--data-path needs a vocabulary: give --tokenizer-type SentencePieceTokenizer --tokenizer-model "
            "PATH.model, or --tokenizer-type NullTokenizer --vocab-size N"
        )

    if args.deepspeed_config is not None:
        _check_readable_file(args.deepspeed_config, "--deepspeed-config", "give a DeepSpeed JSON file")
        try:
            with open(args.deepspeed_config) as f:
                extra = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--deepspeed-config {args.deepspeed_config}: not valid JSON ({e})") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"--deepspeed-config {args.deepspeed_config}: must hold a JSON object, got {type(extra).__name__}")

    batch = batching.resolve_batch(
        dp,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        rampup_batch_size=args.rampup_batch_size,
    )

    padded = None
    if args.vocab_size is not None:
        padded = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
        note = vocab_padding_note(args.vocab_size, args.make_vocab_size_divisible_by, tp)
        if note:
            notes.append(note)

    config = Config(
        model=ModelConfig(
            num_layers=args.num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
            seq_length=args.seq_length, max_position_embeddings=max_pos, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, padded_vocab_size=padded,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
            recompute_activations=args.recompute_activations,
            masked_softmax_fusion=args.masked_softmax_fusion,
            attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        ),
        parallel=ParallelConfig(
            world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            data_parallel_size=dp, zero_stage=args.zero_stage,
            pipeline_partition_method=args.pipeline_partition_method, cpu_offload=args.cpu_offload,
            distributed_backend=args.distributed_backend,
        ),
        batch=batch,
        optimizer=OptimizerConfig(
            lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
            lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=decay_iters,
            weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        ),
        precision=PrecisionConfig(
            bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        ),
        data=DataConfig(
            data_path=tuple(x for pair in data_path for x in (str(pair[0]), pair[1])) if len(data_path) > 1
            else tuple(p for _, p in data_path),
            split=args.split, tokenizer_type=tokenizer_type, tokenizer_model=args.tokenizer_model,
            data_cache_path=args.data_cache_path, num_workers=args.num_workers, eod_mask_loss=args.eod_mask_loss,
        ),
        training=TrainingConfig(
            train_iters=args.train_iters, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
            save=args.save, load=args.load, save_interval=args.save_interval, keep_last=args.keep_last,
            exit_interval=args.exit_interval, exit_signal_handler=args.exit_signal_handler, seed=args.seed,
            deepspeed_config=args.deepspeed_config,
        ),
        logging=LoggingConfig(log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir),
    )
    return config, notes


def _check_partition_method(method: str, num_layers: int, pp: int) -> None:
    if method in ("cost", "uniform", "parameters") or method.startswith("type:"):
        return
    try:
        counts = [int(c) for c in method.split(",")]
    except ValueError:
        raise ConfigError(
            f"--pipeline-partition-method '{method}' is not one of cost, uniform, parameters, type:<regex>, "
            f"or comma-separated layer counts like {','.join(map(str, layers_per_stage_uniform(num_layers, pp)))}"
        ) from None
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(
            f"--pipeline-partition-method {method} must list {pp} stage layer counts, each >= 1, summing to "
            f"--num-layers {num_layers}; e.g. {','.join(map(str, layers_per_stage_uniform(num_layers, pp)))}"
        )


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Tuple[Config, List[str]]:
    """Parse and validate; raises ConfigError. argparse itself exits 2 on unknown flags."""
    args = build_parser().parse_args(argv)
    return validate(args, world_size if world_size is not None else world_size_from_environment())


def is_rank_zero_from_environment() -> bool:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def parse_args_or_exit(argv: Optional[Sequence[str]] = None) -> Config:
    """Entry-point form: print the error (rank 0 only) and exit 2, without a traceback."""
    try:
        config, notes = parse_args(argv)
    except ConfigError as e:
        if is_rank_zero_from_environment():
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if is_rank_zero_from_environment():
        for note in notes:
            print(note, file=sys.stderr, flush=True)
    return config
