"""Command-line flags (Megatron-LM names) -> a `Config`, then `validation.validate()`.

This module only maps flags onto the dataclasses (and parses the few flags
whose syntax is richer than one value); every rule lives in
`megatron_lite.validation`, which runs before any process group exists, so a
bad combination costs the user one clear line instead of a traceback from
inside torch.distributed or DeepSpeed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

from megatron_lite.config import (
    BatchConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)
from megatron_lite.data.tokenizer import TOKENIZER_TYPES
from megatron_lite.training.distributed import is_rank_zero_from_environment
from megatron_lite.validation import validate


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
    g.add_argument("--attention-backend", choices=("auto", "sdpa", "fused"), default="auto",
                   help="sdpa: torch's scaled_dot_product_attention; fused: our fused causal softmax; "
                        "auto (default): the one measured faster on this kind of device")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--attention-softmax-in-fp32", action=argparse.BooleanOptionalAction, default=True,
                   help="softmax of bf16/fp16 attention scores in fp32 (default); --no-attention-softmax-in-fp32 "
                        "keeps the input dtype")

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
    g.add_argument("--timing-breakdown", action="store_true",
                   help="per pipeline stage: forward, backward, time blocked in send/recv, optimizer, at every log line")
    return parser


def world_size_from_environment() -> int:
    """World size as the launcher sets it: torchrun / deepspeed (WORLD_SIZE) or plain srun (SLURM_NTASKS)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def parse_data_path(values: Optional[Sequence[str]]) -> Tuple[Tuple[float, str], ...]:
    """`prefix` -> ((1.0, prefix),); `w1 p1 w2 p2` -> ((w1, p1), (w2, p2)). Syntax only: the
    weights' values and the files are checked by validation."""
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
            pairs.append((float(weight), prefix))
        except ValueError:
            raise ConfigError(f"--data-path weight '{weight}' (before '{prefix}') is not a number") from None
    return tuple(pairs)


def parse_split(split: str) -> Tuple[float, float, float]:
    """Megatron-style '969,30,1' (or '969/30/1') -> (969.0, 30.0, 1.0); missing parts are 0."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split '{split}' must be up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(weights) > 3:
        raise ConfigError(f"--split '{split}' must be up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    return tuple(weights + [0.0] * (3 - len(weights)))


def _section(cls, args: argparse.Namespace, **renamed):
    """The dataclass whose fields have flags of the same name; `renamed` supplies the others."""
    import dataclasses

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(renamed)
    return cls(**values)


def config_from_args(args: argparse.Namespace, world_size: int) -> Config:
    """Flags -> dataclasses, one to one; nothing is checked or derived here."""
    return Config(
        model=_section(ModelConfig, args),
        parallel=_section(ParallelConfig, args, world_size=world_size),
        batch=BatchConfig(
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        ),
        optimizer=_section(OptimizerConfig, args),
        precision=_section(PrecisionConfig, args),
        data=_section(DataConfig, args, data_path=parse_data_path(args.data_path), split=parse_split(args.split)),
        training=_section(TrainingConfig, args),
        logging=_section(LoggingConfig, args),
    )


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Tuple[Config, List[str]]:
    """Parse and validate; raises ConfigError. argparse itself exits 2 on unknown flags."""
    args = build_parser().parse_args(argv)
    world = world_size if world_size is not None else world_size_from_environment()
    return validate(config_from_args(args, world))


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
