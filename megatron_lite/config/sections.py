"""The run's sections other than the model: parallelism, batch, optimizer, precision, data, training, logging."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from megatron_lite.config.flag_values import format_data_path, format_split, parse_data_path, parse_split
from megatron_lite.config.model_moe import MOE
from megatron_lite.config.option import Needs, equals, option

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")
LOG_LEVELS = ("debug", "info", "warning", "error")
TIMEOUT_MINUTES_MAX = 10 ** 7
"""--distributed-timeout-minutes at most (19 years): Python's timedelta, which torch.distributed takes,
overflows near 1.4e12 minutes; past this a value is a typo, not a plan."""
MUON = Needs("optimizer.optimizer", equals("muon"),
             "configure Muon, and --optimizer adam (the default) is AdamW on every parameter", "--optimizer muon")
"""What every --muon-* flag needs."""


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    """Processes in the job, from the launcher's environment (WORLD_SIZE / SLURM_NTASKS)."""
    tensor_model_parallel_size: int = option(1, "--tensor-model-parallel-size", minimum=1)
    """TP degree: ranks that split each matrix (within a node)."""
    pipeline_model_parallel_size: int = option(1, "--pipeline-model-parallel-size", minimum=1)
    """PP degree: stages the layers are split into."""
    context_parallel_size: int = option(1, "--context-parallel-size", minimum=1)
    """CP degree: ranks that split each sample's sequence (world = TP x CP x PP x DP). Each holds
    seq/CP tokens outside attention; inside it an all-to-all gives each all tokens of (heads/TP)/CP
    heads. Gradients are reduced, and ZeRO partitions, over DP x CP."""
    cp_comm_type: str = option("a2a", "--cp-comm-type", choices=("a2a", "p2p"))
    """How context-parallel attention communicates: a2a (all-to-all over heads, as DeepSpeed-Ulysses).
    p2p (ring attention, Megatron-LM's default) is not built and is refused by validation."""
    data_parallel_size: Optional[int] = None
    """DP degree: world_size / (TP x CP x PP), derived by validation."""
    expert_model_parallel_size: int = option(1, "--expert-model-parallel-size", minimum=1, needs=(MOE,))
    """EP degree: ranks that split each MoE layer's experts, taken out of DP x CP (so it divides it); each
    holds --num-experts / EP whole experts (split over TP like the dense MLP). Expert gradients are reduced,
    and ZeRO partitions their state, over the DP x CP / EP ranks that hold the same experts."""
    zero_stage: int = option(0, "--zero-stage", choices=(0, 1, 2, 3))
    """DeepSpeed ZeRO stage; 0 or 1 when --pipeline-model-parallel-size > 1."""
    pipeline_partition_method: str = option("cost", "--pipeline-partition-method")
    """How layers are split into stages: cost (FLOPs per layer, head included), profile (one forward +
    backward of each kind of layer timed on the device at start-up, rank 0's numbers), uniform,
    parameters, type:<regex>, or transformer layers per stage like 3,3,2."""
    pipeline_schedule: str = option("1f1b", "--pipeline-schedule", choices=("1f1b", "dualpipev"))
    """The pipeline schedule at --pipeline-model-parallel-size > 1: 1f1b (DeepSpeed's TrainSchedule, one stage
    per rank) or dualpipev (DeepSpeed's DualPipeVEngine: the layers cut into 2 x PP stages, rank r holding
    stages r and 2 PP - 1 - r, so rank 0 both embeds and computes the loss; needs gradient accumulation steps
    >= 2 x PP; --pipeline-partition-method layer counts then list 2 x PP stages)."""
    sequence_parallel: bool = option(False, "--sequence-parallel")
    """Split LayerNorm, dropout and the residual stream along the sequence across the TP ranks
    (needs --tensor-model-parallel-size > 1 and --seq-length divisible by it); activations outside
    the attention and MLP take 1/TP of the memory."""
    cpu_offload: bool = option(False, "--cpu-offload")
    """Offload optimizer state to CPU through ZeRO (--pipeline-model-parallel-size 1, --zero-stage >= 1)."""
    distributed_backend: Optional[str] = option(None, "--distributed-backend", choices=("nccl", "gloo"))
    """Collective backend; when not given, nccl with CUDA, gloo otherwise."""
    distributed_timeout_minutes: float = option(10.0, "--distributed-timeout-minutes", above=0,
                                                maximum=TIMEOUT_MINUTES_MAX)
    """How long a rank waits in a collective (and at start-up for the others) before the run ends with an
    error naming it: another rank is stuck or died. Fractions allowed (0.5 = 30 s)."""


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: Optional[int] = option(None, "--micro-batch-size", minimum=1)
    """Samples per micro-batch per data-parallel rank; any two of the three batch numbers give the third."""
    global_batch_size: Optional[int] = option(None, "--global-batch-size", minimum=1)
    """Samples per optimizer step over all DP ranks: micro x gradient-accumulation steps x DP."""
    gradient_accumulation_steps: Optional[int] = option(None, "--gradient-accumulation-steps", minimum=1)
    """Micro-batches accumulated per step per DP rank; derived from the other two when left out."""
    rampup_batch_size: Optional[Tuple[int, int, int]] = option(
        None, "--rampup-batch-size", nargs=3, metavar=("START", "INCREMENT", "SAMPLES"), minimum=1)
    """Grow the global batch from START by INCREMENT over the first SAMPLES consumed samples."""


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = option(1e-4, "--lr", above=0)
    """Peak learning rate."""
    min_lr: float = option(0.0, "--min-lr", minimum=0)
    """Learning rate at the end of decay."""
    lr_decay_style: str = option("cosine", "--lr-decay-style", choices=("constant", "linear", "cosine"))
    """Shape of the decay from --lr to --min-lr."""
    lr_warmup_iters: int = option(0, "--lr-warmup-iters", minimum=0)
    """Iterations of linear warmup from 0 to --lr."""
    lr_decay_iters: Optional[int] = option(None, "--lr-decay-iters", minimum=1)
    """Iterations over which the learning rate decays to --min-lr; when not given, --train-iters."""
    override_opt_param_scheduler: bool = option(False, "--override-opt-param-scheduler",
                                                aliases=("--override-opt_param-scheduler",))
    """On a resume whose schedule flags (--lr, --min-lr, --lr-decay-style, --lr-warmup-iters, --lr-decay-iters or
    the --train-iters it follows) differ from the checkpoint's: this run's schedule, from the checkpoint's
    iteration on (Megatron-LM's flag). Without it or the next one such a resume is refused."""
    use_checkpoint_opt_param_scheduler: bool = option(False, "--use-checkpoint-opt-param-scheduler",
                                                      aliases=("--use-checkpoint-opt_param-scheduler",))
    """On such a resume: the checkpoint's schedule, this run's schedule flags set aside (Megatron-LM's flag)."""
    weight_decay: float = option(0.01, "--weight-decay", minimum=0, maximum=10)
    """AdamW weight decay, not applied to biases and norms."""
    adam_beta1: float = option(0.9, "--adam-beta1", minimum=0, below=1)
    """AdamW beta1."""
    adam_beta2: float = option(0.999, "--adam-beta2", minimum=0, below=1)
    """AdamW beta2."""
    adam_eps: float = option(1e-8, "--adam-eps", above=0, maximum=1)
    """AdamW epsilon."""
    clip_grad: float = option(1.0, "--clip-grad", minimum=0, maximum=1e6)
    """Clip the global gradient norm to this; 0 disables clipping."""
    optimizer: str = option("adam", "--optimizer", choices=("adam", "muon"))
    """adam: AdamW on every parameter. muon: Muon on the transformer layers' weight matrices (each of Q, K
    and V, gate and up, and every expert its own matrix, orthogonalised whole at any TP, DP and ZeRO
    stage: training/muon.py), AdamW with the --adam-* flags on the rest (embeddings, output head, norms,
    biases, routers)."""
    muon_momentum: float = option(0.95, "--muon-momentum", minimum=0, below=1, needs=(MUON,))
    """Muon's momentum: its buffer is the gradients' exponential average with this factor."""
    muon_nesterov: bool = option(True, "--muon-nesterov", action="boolean_optional", needs=(MUON,))
    """Orthogonalise the Nesterov look-ahead (the gradient moved toward the buffer by --muon-momentum)
    instead of the buffer itself (--no-muon-nesterov)."""
    muon_num_ns_steps: int = option(5, "--muon-num-ns-steps", minimum=1, maximum=99, needs=(MUON,))
    """Newton-Schulz iterations per matrix and step."""
    muon_scale_mode: str = option("spectral", "--muon-scale-mode",
                                  choices=("spectral", "unit_rms_norm", "shape_scaling"), needs=(MUON,))
    """How the orthogonalised update of an m x n matrix (m outputs, n inputs) is scaled: spectral
    sqrt(max(m, n)) (with the default --muon-extra-scale-factor 0.2: Moonlight's update of AdamW's RMS,
    torch.optim.Muon's match_rms_adamw, so --lr tuned for AdamW carries over), unit_rms_norm
    sqrt(m / n), shape_scaling sqrt(max(1, m / n)) (Keller Jordan's, torch.optim.Muon's default)."""
    muon_extra_scale_factor: float = option(0.2, "--muon-extra-scale-factor", above=0, maximum=1e3, needs=(MUON,))
    """A factor on every Muon update besides --muon-scale-mode's."""
    muon_split_qkv: bool = option(True, "--muon-no-split-qkv", action="store_false", needs=(MUON,))
    """Orthogonalise the fused query/key/value weight as Q, K and V (the default), or as one matrix."""
    muon_split_gate_up: bool = option(True, "--muon-no-split-gate-up", action="store_false", needs=(MUON,))
    """Orthogonalise SwiGLU's fused [gate; up] weight as its two halves (the default), or as one matrix."""
    muon_fp32_matmul_prec: str = option("highest", "--muon-fp32-matmul-prec", choices=("highest", "high", "medium"),
                                        needs=(MUON,))
    """Newton-Schulz matmuls: highest in fp32, so every layout gives the dense update to fp32 rounding; high in
    fp32 at torch's "high" matmul precision (TF32 on CUDA); medium in bf16, torch.optim.Muon's (faster on GPUs,
    but the bf16 cast turns the layouts' fp32 rounding differences into bf16-sized ones: 7e-5 relative in the
    third loss of tests/training/test_muon_parallel.py's TP 2 layout, against below 1e-5 at highest)."""
    muon_tp_mode: str = option("duplicated", "--muon-tp-mode", choices=("duplicated", "blockwise"),
                               needs=(MUON,))
    """duplicated: each TP rank gathers a split matrix whole and orthogonalises it (the dense update at any
    TP). blockwise: each rank orthogonalises its own shard (Megatron-LM's blockwise mode: cheaper, but not
    the dense update; a different optimizer per TP size)."""


@dataclass(frozen=True)
class PrecisionConfig:
    bf16: bool = option(False, "--bf16")
    """Train in bfloat16."""
    fp16: bool = option(False, "--fp16")
    """Train in float16 with loss scaling (needs --zero-stage 1 and a device with fp16 kernels)."""
    loss_scale: Optional[float] = option(None, "--loss-scale", above=0, maximum=2.0 ** 40)
    """Static loss scale for fp16; when not given, dynamic."""
    initial_loss_scale: float = option(2.0 ** 32, "--initial-loss-scale", above=0, maximum=2.0 ** 40)
    """Starting dynamic loss scale."""
    min_loss_scale: float = option(1.0, "--min-loss-scale", above=0, maximum=2.0 ** 40)
    """Floor of the dynamic loss scale."""
    loss_scale_window: int = option(1000, "--loss-scale-window", minimum=1)
    """Steps without overflow before the dynamic scale grows."""
    hysteresis: int = option(2, "--hysteresis", minimum=1)
    """Overflows tolerated before the dynamic scale shrinks."""
    accumulate_allreduce_grads_in_fp32: Optional[bool] = option(
        None, "--accumulate-allreduce-grads-in-fp32", action="boolean_optional")
    """With --bf16: accumulate gradients over micro-batches and all-reduce them in fp32 (DeepSpeed's
    BF16_Optimizer with data_types.grad_accum_dtype and communication_data_type fp32). Default: on
    for --bf16 at --zero-stage 1, as Megatron-LM does for bf16; DeepSpeed 0.19 offers it nowhere else
    (docs/precision.md). --no-accumulate-allreduce-grads-in-fp32 keeps bf16 gradients."""

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(frozen=True)
class DataConfig:
    data_path: Tuple[Tuple[float, str], ...] = option(
        (), "--data-path", nargs="+", metavar="[WEIGHT] PREFIX", parse=parse_data_path, unparse=format_data_path)
    """A dataset prefix (tools/preprocess_data.py's PREFIX_text_document), or weights and prefixes to
    blend: 0.3 prefixA 0.7 prefixB."""
    split: Tuple[float, float, float] = option(
        (969.0, 30.0, 1.0), "--split", parse=parse_split, unparse=lambda split: [format_split(split)])
    """Train, valid, test weights over documents, e.g. 969,30,1 (missing parts are 0)."""
    tokenizer_type: Optional[str] = option(None, "--tokenizer-type", choices=TOKENIZER_TYPES)
    """Tokenizer kind; when not given, inferred from the other tokenizer flags."""
    tokenizer_model: Optional[str] = option(None, "--tokenizer-model")
    """The SentencePiece .model, or for HuggingFaceTokenizer a Hugging Face tokenizer folder or its tokenizer.json."""
    vocab_file: Optional[str] = option(None, "--vocab-file")
    """GPT2BPETokenizer: GPT-2-style vocab.json (token -> id)."""
    merge_file: Optional[str] = option(None, "--merge-file")
    """GPT2BPETokenizer: GPT-2-style merges.txt (one merge per line after the '#version' header)."""
    data_cache_path: Optional[str] = option(None, "--data-cache-path")
    """Folder for cached sample indices; when not given, cache/ next to the data (must be shared across nodes)."""
    num_workers: int = option(1, "--num-workers", minimum=0)
    """DataLoader workers per rank."""
    eod_mask_loss: bool = option(False, "--eod-mask-loss")
    """Exclude end-of-document tokens from the loss."""


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int = option(10, "--train-iters", minimum=1)
    """Optimizer steps to train for."""
    eval_interval: int = option(1000, "--eval-interval", minimum=1)
    """Evaluate every this many steps."""
    eval_iters: int = option(10, "--eval-iters", minimum=0)
    """Batches per evaluation; 0 disables evaluation."""
    save: Optional[str] = option(None, "--save")
    """Checkpoint folder to write."""
    load: Optional[str] = option(None, "--load")
    """Checkpoint folder to resume from."""
    use_checkpoint_args: bool = option(False, "--use-checkpoint-args")
    """Take the model's shape flags (layers, widths, heads, query groups, block options, vocabulary, position
    type, maximum positions) from --load's checkpoint; flags given on the command line must agree with it.
    --seq-length stays this run's. Its tokenizer (--tokenizer-type and its files) too, unless one is given."""
    finetune: bool = option(False, "--finetune")
    """Load only the weights of --load's checkpoint: iteration 0, a fresh optimizer and learning-rate
    schedule, the data from its start (Megatron-LM's --finetune). An imported checkpoint always starts so."""
    save_interval: Optional[int] = option(None, "--save-interval", minimum=1)
    """Save every this many steps; needs --save."""
    keep_last: Optional[int] = option(None, "--keep-last", minimum=1)
    """Keep only this many newest checkpoints."""
    async_save: bool = option(False, "--async-save")
    """Write checkpoints in the background: a save copies this rank's checkpoint to host memory (its size
    once more, until written) and training goes on; the checkpoint becomes `latest` once every rank's files
    are on disk. One save at a time (the next waits); the run's end waits for the last one."""
    exit_interval: Optional[int] = option(None, "--exit-interval", minimum=1)
    """Save and exit when the iteration is a multiple of this."""
    exit_signal_handler: bool = option(False, "--exit-signal-handler")
    """Save and exit 0 on SIGTERM/SIGUSR1 at the next step boundary."""
    iterations_to_skip: Tuple[int, ...] = option((), "--iterations-to-skip", nargs="+", minimum=1)
    """Iterations (1-based, as the log counts them) whose global batch is read and not trained on: the weights,
    optimizer state and learning-rate schedule stay as they were, the data position and the iteration advance
    (Megatron-LM's flag; for a batch that spiked or broke a step, given on the resume that follows)."""
    seed: int = option(1234, "--seed", minimum=0)
    """Seed of every random generator."""
    deepspeed_config: Optional[str] = option(None, "--deepspeed-config")
    """Extra DeepSpeed JSON merged under ours (a value it sets that a flag also sets must agree)."""
    deepspeed_config_contents: Optional[Dict[str, Any]] = None
    """That file's JSON object, read once by validation; may also be given directly in code."""


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = option(100, "--log-interval", minimum=1)
    """Print and record metrics every this many steps."""
    tensorboard_dir: Optional[str] = option(None, "--tensorboard-dir")
    """Write TensorBoard events, and metrics.jsonl (one JSON record per log interval, the memory
    check, the run's summary), here."""
    timing_breakdown: bool = option(False, "--timing-breakdown")
    """Print (and record) each pipeline stage's forward, backward, send/recv and optimizer time at
    every log line."""
    log_level: str = option("warning", "--log-level", choices=LOG_LEVELS)
    """Level of library logging (DeepSpeed, torch, ours); info also shows DeepSpeed's start-up lines."""
    log_straggler: bool = option(False, "--log-straggler")
    """At every log line, name the slowest and fastest ranks (rank, TP/PP/DP place, host) by the time each
    spent working rather than waiting for the others, with their phase times (training/stragglers.py)."""
    straggler_minmax_count: int = option(1, "--straggler-minmax-count", minimum=1)
    """With --log-straggler: how many of the slowest and of the fastest ranks to name."""
