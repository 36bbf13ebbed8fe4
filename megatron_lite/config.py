"""Typed, immutable run configuration: data, no rules.

`arguments.py` maps Megatron-LM-named flags onto these dataclasses; code (tests,
benchmarks, the tuning planner) builds them directly. Either way a `Config` is
checked and completed by `megatron_lite.validation.validate()`, which fills
the fields documented as derived and refuses inconsistent ones. Each field's docstring names the flag that sets it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


class ConfigError(ValueError):
    """An inconsistent or unusable flag; the message names the flag, the value and a fix."""


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Smallest multiple of divisible_by x TP that holds vocab_size, so every TP rank owns an equal slice."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def vocab_padding_note(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> Optional[str]:
    """The line rank 0 logs when padding changes the vocabulary, else None."""
    padded = pad_vocab_size(vocab_size, divisible_by, tensor_model_parallel_size)
    if padded == vocab_size:
        return None
    return (f"vocabulary {vocab_size} padded to {padded} (multiple of --make-vocab-size-divisible-by "
            f"{divisible_by} x TP {tensor_model_parallel_size})")


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    """Transformer layers (`--num-layers`)."""
    hidden_size: int = 64
    """Width of the residual stream (`--hidden-size`)."""
    num_attention_heads: int = 4
    """Attention heads; split whole across TP ranks (`--num-attention-heads`)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means 4 x hidden, filled by validation (`--ffn-hidden-size`)."""
    seq_length: int = 128
    """Tokens per sample (`--seq-length`)."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table, >= seq_length; None means seq_length (`--max-position-embeddings`)."""
    vocab_size: Optional[int] = None
    """Tokenizer vocabulary before padding: the SentencePiece model's size, or `--vocab-size` for NullTokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x TP so it splits evenly (`--make-vocab-size-divisible-by`)."""
    padded_vocab_size: Optional[int] = None
    """Vocabulary after padding for TP; derived by validation, never set by a flag."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches and embeddings (`--hidden-dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (`--attention-dropout`)."""
    position_embedding_type: str = "learned_absolute"
    """`learned_absolute` or `rope` (`--position-embedding-type`)."""
    rotary_base: int = 10000
    """Base of the rotary frequencies (`--rotary-base`)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output head its own weight instead of reusing the embedding (`--untie-embeddings-and-output-weights`)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation (`--init-method-std`)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (`--layernorm-epsilon`)."""
    recompute_activations: bool = False
    """Recompute each transformer layer's activations in backward (`--recompute-activations`)."""
    attention_backend: str = "auto"
    """Attention kernel: `sdpa` (torch's scaled_dot_product_attention), `fused` (our scaled-masked
    softmax between two matmuls), or `auto`: the one measured faster on the device (`--attention-backend`)."""
    masked_softmax_fusion: bool = True
    """Use the fused scaled-masked softmax kernel where it applies (`--no-masked-softmax-fusion` turns it off)."""
    attention_softmax_in_fp32: bool = True
    """Compute the attention softmax in fp32 for bf16/fp16 inputs (`--[no-]attention-softmax-in-fp32`)."""


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    """Processes in the job, from the launcher's environment (WORLD_SIZE / SLURM_NTASKS)."""
    tensor_model_parallel_size: int = 1
    """TP degree: ranks that split each matrix (`--tensor-model-parallel-size`)."""
    pipeline_model_parallel_size: int = 1
    """PP degree: stages the layers are split into (`--pipeline-model-parallel-size`)."""
    data_parallel_size: Optional[int] = None
    """DP degree: world_size / (TP x PP), derived by validation."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3; 0 or 1 when PP > 1 (`--zero-stage`)."""
    pipeline_partition_method: str = "cost"
    """How layers are split into stages: cost, uniform, parameters, type:<regex> or a list like 3,3,2 (`--pipeline-partition-method`)."""
    cpu_offload: bool = False
    """Offload optimizer state to CPU through ZeRO (PP = 1, ZeRO >= 1) (`--cpu-offload`)."""
    distributed_backend: Optional[str] = None
    """nccl or gloo; default nccl with CUDA, gloo otherwise (`--distributed-backend`)."""


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: Optional[int] = None
    """Samples per micro-batch per data-parallel rank (`--micro-batch-size`); any two of the three
    batch numbers give the third (see batching.py)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all DP ranks: micro x gas x DP (`--global-batch-size`)."""
    gradient_accumulation_steps: Optional[int] = None
    """Micro-batches accumulated per step per DP rank (`--gradient-accumulation-steps`, or derived)."""
    rampup_batch_size: Optional[Tuple[int, int, int]] = None
    """(start, increment, ramp samples): grow the global batch during the first samples (`--rampup-batch-size`)."""


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    """Peak learning rate (`--lr`)."""
    min_lr: float = 0.0
    """Learning rate at the end of decay (`--min-lr`)."""
    lr_decay_style: str = "cosine"
    """constant, linear or cosine (`--lr-decay-style`)."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 to lr (`--lr-warmup-iters`)."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which lr decays to min_lr; default train_iters (`--lr-decay-iters`)."""
    weight_decay: float = 0.01
    """AdamW weight decay, not applied to biases and norms (`--weight-decay`)."""
    adam_beta1: float = 0.9
    """AdamW beta1 (`--adam-beta1`)."""
    adam_beta2: float = 0.999
    """AdamW beta2 (`--adam-beta2`)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (`--adam-eps`)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables (`--clip-grad`)."""


@dataclass(frozen=True)
class PrecisionConfig:
    bf16: bool = False
    """Train in bfloat16 (`--bf16`)."""
    fp16: bool = False
    """Train in float16 with loss scaling (`--fp16`)."""
    loss_scale: Optional[float] = None
    """Static loss scale for fp16; None means dynamic (`--loss-scale`)."""
    initial_loss_scale: float = 2.0 ** 32
    """Starting dynamic loss scale (`--initial-loss-scale`)."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale (`--min-loss-scale`)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale grows (`--loss-scale-window`)."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale shrinks (`--hysteresis`)."""

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(frozen=True)
class DataConfig:
    data_path: Tuple[Tuple[float, str], ...] = ()
    """(weight, prefix) pairs to blend; one prefix has weight 1 (`--data-path prefix` or `w1 p1 w2 p2`)."""
    split: Tuple[float, float, float] = (969.0, 30.0, 1.0)
    """Train, valid, test weights over documents, as given (`--split 969,30,1`)."""
    tokenizer_type: Optional[str] = None
    """SentencePieceTokenizer or NullTokenizer; inferred from the other tokenizer flags when None (`--tokenizer-type`)."""
    tokenizer_model: Optional[str] = None
    """Path of the SentencePiece model (`--tokenizer-model`)."""
    data_cache_path: Optional[str] = None
    """Folder for cached sample indices; default next to the data (`--data-cache-path`)."""
    num_workers: int = 1
    """DataLoader workers per rank (`--num-workers`)."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss (`--eod-mask-loss`)."""


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int = 10
    """Optimizer steps to train for (`--train-iters`)."""
    eval_interval: int = 1000
    """Evaluate every this many steps (`--eval-interval`)."""
    eval_iters: int = 10
    """Batches per evaluation (`--eval-iters`)."""
    save: Optional[str] = None
    """Checkpoint folder to write (`--save`)."""
    load: Optional[str] = None
    """Checkpoint folder to resume from (`--load`)."""
    save_interval: Optional[int] = None
    """Save every this many steps; needs --save (`--save-interval`)."""
    keep_last: Optional[int] = None
    """Keep only this many newest checkpoints (`--keep-last`)."""
    exit_interval: Optional[int] = None
    """Save and exit when the iteration is a multiple of this (`--exit-interval`)."""
    exit_signal_handler: bool = False
    """Save and exit 0 on SIGTERM/SIGUSR1 at the next step boundary (`--exit-signal-handler`)."""
    seed: int = 1234
    """Seed of every random generator (`--seed`)."""
    deepspeed_config: Optional[str] = None
    """Extra DeepSpeed JSON merged under ours (`--deepspeed-config`)."""
    deepspeed_config_contents: Optional[Dict[str, Any]] = None
    """That file's JSON object, read once by validation; may also be given directly in code."""


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    """Print and record metrics every this many steps (`--log-interval`)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard events here (`--tensorboard-dir`)."""
    timing_breakdown: bool = False
    """Print (and record) each pipeline stage's forward, backward, send/recv and optimizer time at every
    log line (`--timing-breakdown`)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and regularisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / DP degrees and ZeRO."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Micro-batch, gradient accumulation and global batch."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and the learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """fp32 / bf16 / fp16 and loss scaling."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and tokenizer."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Iterations, evaluation, checkpoints, seed."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console and TensorBoard logging."""

    def replace(self, **sections) -> "Config":
        """A copy with whole sections or `section__field=value` entries replaced."""
        updates = {}
        for key, value in sections.items():
            if "__" in key:
                section, name = key.split("__", 1)
                base = updates.get(section, getattr(self, section))
                updates[section] = dataclasses.replace(base, **{name: value})
            else:
                updates[key] = value
        return dataclasses.replace(self, **updates)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Config":
        """Inverse of to_dict (e.g. a checkpoint's saved config); JSON lists become tuples again."""
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # every section field has its dataclass as factory
            known = {g.name for g in dataclasses.fields(section_cls)}
            values = {k: _tuples(v) for k, v in data.get(f.name, {}).items() if k in known}
            sections[f.name] = section_cls(**values)
        return cls(**sections)


def format_split(split: Tuple[float, ...]) -> str:
    """(969.0, 30.0, 1.0) -> '969,30,1', as the user wrote it."""
    return ",".join(f"{w:g}" for w in split)


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
