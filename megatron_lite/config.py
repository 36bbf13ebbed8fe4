"""Typed, immutable run configuration: data, no rules; and the one source of every flag.

Each field set from the command line carries its Megatron-LM flag name (and, where
argparse needs more than the type, its action, choices or nargs) in its metadata,
and its docstring is the flag's help: `arguments.py` builds the parser from these
dataclasses, so a new flag is a new field with `option(...)` and a docstring.
Fields without a flag are derived by validation or come from the launcher.

Code (tests, benchmarks, the tuning planner) builds these dataclasses directly.
Either way a `Config` is checked and completed by `megatron_lite.validation.validate()`,
which fills the fields documented as derived and refuses inconsistent ones.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")
LOG_LEVELS = ("debug", "info", "warning", "error")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class ConfigError(ValueError):
    """An inconsistent or unusable flag; the message names the flag, the value and a fix.

    `code` says what kind of problem it is (e.g. `batch_not_divisible`), for tools that sort
    problems (the tuning planner's rejections); `codes` lists one per problem when validation
    found several."""

    def __init__(self, message: str, code: str = "invalid", codes: Optional[Sequence[str]] = None):
        super().__init__(message)
        self.codes = tuple(codes) if codes else (code,)
        self.code = self.codes[0]


TIMEOUT_MINUTES_MAX = 10 ** 7
"""--distributed-timeout-minutes at most (19 years): Python's timedelta, which torch.distributed takes,
overflows near 1.4e12 minutes; past this a value is a typo, not a plan."""


def option(default: Any, flag: str, **cli: Any) -> Any:
    """A field set by `flag` (Megatron-LM's name). `cli` holds what argparse needs beyond the
    field's type: action (store_true is implied for a bool defaulting to False; store_false and
    boolean_optional), choices, nargs, metavar, aliases, and parse / unparse (flag values <->
    field value) for fields whose syntax is richer than one value; and a number's range, as
    flag_numbers.problem() takes it: minimum / maximum (inclusive), above / below (exclusive),
    which validation's number_rules checks for every value, from a flag or from code."""
    return field(default=default, metadata={"flag": flag, **cli})


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


def format_data_path(data_path: Tuple[Tuple[float, str], ...]) -> List[str]:
    """Inverse of parse_data_path."""
    if len(data_path) == 1 and data_path[0][0] == 1.0:
        return [data_path[0][1]]
    return [text for weight, prefix in data_path for text in (repr(float(weight)), prefix)]


def parse_split(split: str) -> Tuple[float, float, float]:
    """Megatron-style '969,30,1' (or '969/30/1') -> (969.0, 30.0, 1.0); missing parts are 0."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split '{split}' must be up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(weights) > 3:
        raise ConfigError(f"--split '{split}' must be up to three non-negative numbers with a positive sum, "
                          f"e.g. 969,30,1")
    return tuple(weights + [0.0] * (3 - len(weights)))


def parse_window_size(text: str) -> Tuple[int, int]:
    """Megatron-LM's --window-size 'L,R' (a token sees the L tokens before it, itself, and R after it) or 'L'
    (= 'L,0') -> (L, R). Syntax only: the values are validation's."""
    parts = text.split(",")
    try:
        window = tuple(int(p) for p in parts)
    except ValueError:
        window = ()
    if len(window) not in (1, 2):
        raise ConfigError(f"--window-size '{text}' must be L or L,R (tokens seen before and after a token), e.g. "
                          f"127,0 for a 128-token causal window")
    return window if len(window) == 2 else (window[0], 0)


def parse_moe_layer_freq(text: str) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """--moe-layer-freq's syntax -> (its canonical text, the pattern or None for an int N). An int N >= 1, or a
    pattern of 0s and 1s: a list [0,1,1] or Megatron-LM's ([0]*1+[1]*5) (list literals of 0/1 joined by +, each
    optionally times a count); parsed, never evaluated as code."""
    body = text.replace(" ", "")
    if body.isdigit() and int(body) >= 1:
        return body, None
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    pattern: List[int] = []
    for term in body.split("+") if body else [""]:
        items, _, times = term.partition("]*")
        if not items.startswith("[") or (times and not times.isdigit()):
            pattern = []
            break
        if not times:
            items = items.rstrip("]")
        values = items[1:].split(",")
        if not all(v in ("0", "1") for v in values):
            pattern = []
            break
        pattern += [int(v) for v in values] * (int(times) if times else 1)
    if not pattern:
        raise ConfigError(f"--moe-layer-freq '{text}' must be an integer N >= 1 (every N-th layer is MoE) or a "
                          f"pattern of 0 (dense) and 1 (MoE) per layer like ([0]*1+[1]*3) or [0,1,1,1]")
    return text.replace(" ", ""), tuple(pattern)


def format_window_size(window: Tuple[int, int]) -> List[str]:
    return [f"{window[0]},{window[1]}"]


def format_split(split: Tuple[float, ...]) -> str:
    """(969.0, 30.0, 1.0) -> '969,30,1', as the user wrote it."""
    return ",".join(f"{w:g}" for w in split)


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
    num_layers: int = option(2, "--num-layers", minimum=1)
    """Transformer layers."""
    hidden_size: int = option(64, "--hidden-size", minimum=1)
    """Width of the residual stream."""
    num_attention_heads: int = option(4, "--num-attention-heads", minimum=1)
    """Attention heads; split whole across TP ranks."""
    ffn_hidden_size: Optional[int] = option(None, "--ffn-hidden-size", minimum=1)
    """MLP inner width; when not given, 4 x --hidden-size (filled by validation)."""
    seq_length: int = option(128, "--seq-length", minimum=1)
    """Tokens per sample."""
    max_position_embeddings: Optional[int] = option(None, "--max-position-embeddings", minimum=1)
    """Rows of the learned position table, >= --seq-length; when not given, --seq-length."""
    vocab_size: Optional[int] = option(None, "--vocab-size", minimum=1)
    """Tokenizer vocabulary before padding: the tokenizer's own size when it has files (then this flag must
    agree with it, or be left out), or the size for --tokenizer-type NullTokenizer."""
    make_vocab_size_divisible_by: int = option(128, "--make-vocab-size-divisible-by", minimum=1)
    """Pad the vocabulary to a multiple of this x TP so it splits evenly."""
    padded_vocab_size: Optional[int] = None
    """Vocabulary after padding for TP; derived by validation, never set by a flag."""
    hidden_dropout: float = option(0.1, "--hidden-dropout", minimum=0, below=1)
    """Dropout on the residual branches and embeddings."""
    attention_dropout: float = option(0.1, "--attention-dropout", minimum=0, below=1)
    """Dropout on attention probabilities."""
    position_embedding_type: str = option("learned_absolute", "--position-embedding-type",
                                          choices=("learned_absolute", "rope"))
    """Learned absolute positions (GPT-2) or rotary embeddings."""
    rotary_base: int = option(10000, "--rotary-base", minimum=1)
    """Base of the rotary frequencies."""
    untie_embeddings_and_output_weights: bool = option(False, "--untie-embeddings-and-output-weights")
    """Give the output head its own weight instead of reusing the embedding."""
    init_method_std: float = option(0.02, "--init-method-std", minimum=0, maximum=100)
    """Standard deviation of the normal weight initialisation."""
    norm_epsilon: float = option(1e-5, "--norm-epsilon", above=0, maximum=1, aliases=("--layernorm-epsilon",))
    """Epsilon of every LayerNorm or RMSNorm (--layernorm-epsilon is its older name, as in Megatron-LM)."""
    normalization: str = option("LayerNorm", "--normalization", choices=NORMALIZATIONS)
    """Normalisation of the layers and the final norm: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    swiglu: bool = option(False, "--swiglu")
    """SiLU-gated MLP (Llama): down(silu(gate(x)) * up(x)); --ffn-hidden-size is the gated width, and when
    not given it is Megatron-LM's int(4 x hidden x 2/3 / 64) x 64."""
    openai_gelu: bool = option(False, "--openai-gelu")
    """GeLU's tanh approximation, as OpenAI's GPT-2 (Hugging Face's gelu_new) computes it; default: exact (erf)."""
    group_query_attention: bool = option(False, "--group-query-attention")
    """Grouped-query attention: --num-query-groups key/value heads, each shared by a group of query heads."""
    num_query_groups: Optional[int] = option(None, "--num-query-groups", minimum=1)
    """Key/value heads with --group-query-attention (1 = multi-query attention); otherwise one per attention
    head (filled by validation)."""
    kv_channels: Optional[int] = option(None, "--kv-channels", minimum=1)
    """Width of each attention head (queries, keys and values alike), apart from --hidden-size: attention
    projects h -> heads x this and back (Qwen3's and Gemma's head_dim); when not given, --hidden-size /
    --num-attention-heads."""
    qk_layernorm: bool = option(False, "--qk-layernorm")
    """Normalise every query and key head after the QKV projection and before RoPE, as Qwen3 does: the
    --normalization kind over the head's --kv-channels, one weight (and bias) shared by all heads, with
    --norm-epsilon."""
    add_bias_linear: bool = option(True, "--disable-bias-linear", action="store_false")
    """Drop the bias of every linear layer (attention and MLP), as Llama does."""
    add_qkv_bias: bool = option(False, "--add-qkv-bias")
    """Give the fused QKV linear a bias even with --disable-bias-linear, as Qwen2 and Qwen2-MoE have (biases
    on q_proj, k_proj and v_proj only); with biases everywhere it changes nothing."""
    use_rope_scaling: bool = option(False, "--use-rope-scaling")
    """Llama 3.1's rotary frequency scaling (low/high-frequency factors 1 and 4, original context 8192)."""
    rope_scaling_factor: float = option(8.0, "--rope-scaling-factor", minimum=1, maximum=1024)
    """With --use-rope-scaling: the factor long wavelengths are divided by."""
    recompute_activations: bool = option(False, "--recompute-activations")
    """Megatron-LM's shorthand for --recompute-granularity selective (recompute the attention core in
    backward); before issue 23 this flag recomputed whole layers (now --recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1)."""
    recompute_granularity: Optional[str] = option(None, "--recompute-granularity", choices=("full", "selective"))
    """Activation recompute: full (whole transformer layers, as --recompute-method and
    --recompute-num-layers say; only their inputs are kept) or selective (the attention core: scores,
    softmax, dropout and x V); when not given, none (or selective with --recompute-activations)."""
    recompute_method: Optional[str] = option(None, "--recompute-method", choices=("uniform", "block"))
    """With --recompute-granularity full: uniform (each pipeline stage's layers in chunks of
    --recompute-num-layers, each chunk recomputed from its input) or block (the first
    --recompute-num-layers layers of each stage recomputed one by one, the rest not)."""
    recompute_num_layers: Optional[int] = option(None, "--recompute-num-layers", minimum=1)
    """With --recompute-granularity full: layers per recomputed chunk (uniform) or recomputed layers per
    pipeline stage (block)."""
    attention_backend: str = option("auto", "--attention-backend", choices=("auto", "sdpa", "fused"))
    """Attention kernel: sdpa (torch's scaled_dot_product_attention), fused (our fused scaled-masked
    causal softmax between two matmuls), or auto: SDPA, measured faster on CPU and taken on CUDA until
    the GPU check measures otherwise (model/transformer.py AUTO_ATTENTION_BACKEND)."""
    masked_softmax_fusion: bool = option(True, "--no-masked-softmax-fusion", action="store_false")
    """Turn off the fused scaled-masked softmax kernel (eager torch ops instead)."""
    attention_softmax_in_fp32: bool = option(True, "--attention-softmax-in-fp32", action="boolean_optional")
    """Softmax of bf16/fp16 attention scores in fp32; --no-attention-softmax-in-fp32 keeps the input dtype."""
    reset_attention_mask: bool = option(False, "--reset-attention-mask")
    """Documents packed into one sample do not see each other: a token attends only to the earlier tokens
    of its own document (the one an end-of-document token closes), as Megatron-LM's flag."""
    reset_position_ids: bool = option(False, "--reset-position-ids")
    """Positions restart at 0 after each end-of-document token (learned and rotary positions alike)."""
    window_size: Optional[Tuple[int, int]] = option(None, "--window-size", parse=parse_window_size,
                                                    unparse=format_window_size, metavar="L[,R]")
    """Sliding-window attention, as Megatron-LM and Transformer Engine write it: a token attends to the L
    tokens before it and itself (R, the tokens after it, is 0 for causal training); 127,0 is gpt-oss's
    128-token window. A single number L means L,0. Default: no window."""
    window_attn_skip_freq: Optional[int] = option(None, "--window-attn-skip-freq", minimum=1)
    """With --window-size: every N-th layer (layer numbers N, 2N, ... counted from 1) attends globally, the
    others through the window (gpt-oss: 2)."""

    num_experts: Optional[int] = option(None, "--num-experts", minimum=1)
    """Routed experts per MoE layer (Mixture of Experts); when not given, every layer has the dense MLP."""
    moe_ffn_hidden_size: Optional[int] = option(None, "--moe-ffn-hidden-size", minimum=1)
    """Inner width of each routed expert (gated width with --swiglu); when not given, --ffn-hidden-size."""
    moe_router_topk: int = option(2, "--moe-router-topk", minimum=1)
    """Experts each token is routed to."""
    moe_layer_freq: str = option("1", "--moe-layer-freq", parse=lambda text: parse_moe_layer_freq(text)[0],
                                 metavar="N|PATTERN")
    """Which layers are MoE: N = every N-th layer from the first (layer numbers 1, 1+N, ...), or a pattern
    with one 0 (dense) or 1 (MoE) per layer, written as Megatron-LM writes it: ([0]*1+[1]*5) or [0,1,1,1]."""
    moe_router_score_function: str = option("softmax", "--moe-router-score-function",
                                            choices=("softmax", "sigmoid"))
    """Router scores: softmax over the experts (Mixtral, Qwen) or an independent sigmoid per expert
    (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = option(False, "--moe-router-pre-softmax")
    """softmax scoring: softmax over all experts, then top-k, weights not renormalised (Qwen2-MoE without
    norm_topk_prob); default: top-k of the logits, then softmax over the k (Mixtral: renormalised)."""
    moe_router_topk_scaling_factor: Optional[float] = option(None, "--moe-router-topk-scaling-factor", above=0,
                                                             maximum=1e6)
    """Multiply the chosen experts' weights by this (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    moe_router_num_groups: Optional[int] = option(None, "--moe-router-num-groups", minimum=1)
    """Group-limited routing: the experts form this many groups; a token first keeps
    --moe-router-group-topk groups (each scored by the sum of its two best experts), then takes its top-k
    inside them (DeepSeek-V3's n_group)."""
    moe_router_group_topk: Optional[int] = option(None, "--moe-router-group-topk", minimum=1)
    """Groups each token may route into, with --moe-router-num-groups (DeepSeek-V3's topk_group)."""
    moe_router_load_balancing_type: str = option("aux_loss", "--moe-router-load-balancing-type",
                                                 choices=("aux_loss", "seq_aux_loss", "none"))
    """Load-balancing loss: aux_loss (Switch/GShard, over each micro-batch's tokens), seq_aux_loss (per
    sequence, DeepSeek-V3) or none; its weight is --moe-aux-loss-coeff."""
    moe_aux_loss_coeff: float = option(0.0, "--moe-aux-loss-coeff", minimum=0, maximum=1e6)
    """Weight of the load-balancing loss (0: off)."""
    moe_z_loss_coeff: Optional[float] = option(None, "--moe-z-loss-coeff", minimum=0, maximum=1e6)
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits; ST-MoE); off when not given."""
    moe_router_enable_expert_bias: bool = option(False, "--moe-router-enable-expert-bias")
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose experts (never
    to weight them), moved after each global batch by --moe-router-bias-update-rate towards equal load."""
    moe_router_bias_update_rate: float = option(1e-3, "--moe-router-bias-update-rate", minimum=0, maximum=1e6)
    """Step of the expert-bias update: bias += rate x sign(mean load - expert load), once per global batch."""
    moe_shared_expert_intermediate_size: Optional[int] = option(None, "--moe-shared-expert-intermediate-size",
                                                                minimum=1)
    """Inner width of an MLP every token passes through beside its routed experts (DeepSeek, Qwen2-MoE's
    shared expert); none when not given."""
    moe_shared_expert_gate: bool = option(False, "--moe-shared-expert-gate")
    """Scale the shared expert's output by sigmoid(x . w), a learned per-token gate (Qwen2-MoE)."""
    moe_expert_capacity_factor: Optional[float] = option(None, "--moe-expert-capacity-factor", above=0,
                                                         maximum=1e6)
    """Each expert takes at most ceil(tokens x top-k / experts x this) of a rank's tokens per micro-batch,
    the rest are dropped (their expert output is 0); when not given, dropless."""
    moe_token_drop_policy: str = option("probs", "--moe-token-drop-policy", choices=("probs", "position"))
    """With a capacity: an expert keeps its highest-weighted tokens (probs) or its first ones (position)."""
    moe_token_dispatcher_type: str = option("alltoall", "--moe-token-dispatcher-type", choices=("alltoall",))
    """How tokens reach their experts' ranks: alltoall (one all-to-all over the expert-parallel group there
    and one back; the only dispatcher built)."""
    moe_grouped_gemm: bool = option(False, "--moe-grouped-gemm")
    """Run a rank's experts as one grouped GEMM (torch._grouped_mm, CUDA) instead of one GEMM per expert; on
    CPU torch's grouped GEMM has no backward, so the per-expert loop runs there either way."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head: --kv-channels, or --hidden-size / --num-attention-heads when not given."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV linear has a bias: every linear's (no --disable-bias-linear), or --add-qkv-bias."""
        return self.add_bias_linear or self.add_qkv_bias


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
    expert_model_parallel_size: int = option(1, "--expert-model-parallel-size", minimum=1)
    """EP degree: ranks that split each MoE layer's experts, taken out of DP x CP (so it divides it); each
    holds --num-experts / EP whole experts (split over TP like the dense MLP). Expert gradients are reduced,
    and ZeRO partitions their state, over the DP x CP / EP ranks that hold the same experts."""
    zero_stage: int = option(0, "--zero-stage", choices=(0, 1, 2, 3))
    """DeepSpeed ZeRO stage; 0 or 1 when --pipeline-model-parallel-size > 1."""
    pipeline_partition_method: str = option("cost", "--pipeline-partition-method")
    """How layers are split into stages: cost (FLOPs per layer, head included), profile (one forward +
    backward of each kind of layer timed on the device at start-up, rank 0's numbers), uniform,
    parameters, type:<regex>, or transformer layers per stage like 3,3,2."""
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
    muon_momentum: float = option(0.95, "--muon-momentum", minimum=0, below=1)
    """Muon's momentum: its buffer is the gradients' exponential average with this factor."""
    muon_nesterov: bool = option(True, "--muon-nesterov", action="boolean_optional")
    """Orthogonalise the Nesterov look-ahead (the gradient moved toward the buffer by --muon-momentum)
    instead of the buffer itself (--no-muon-nesterov)."""
    muon_num_ns_steps: int = option(5, "--muon-num-ns-steps", minimum=1, maximum=99)
    """Newton-Schulz iterations per matrix and step."""
    muon_scale_mode: str = option("spectral", "--muon-scale-mode",
                                  choices=("spectral", "unit_rms_norm", "shape_scaling"))
    """How the orthogonalised update of an m x n matrix (m outputs, n inputs) is scaled: spectral
    sqrt(max(m, n)) (with the default --muon-extra-scale-factor 0.2: Moonlight's update of AdamW's RMS,
    torch.optim.Muon's match_rms_adamw, so --lr tuned for AdamW carries over), unit_rms_norm
    sqrt(m / n), shape_scaling sqrt(max(1, m / n)) (Keller Jordan's, torch.optim.Muon's default)."""
    muon_extra_scale_factor: float = option(0.2, "--muon-extra-scale-factor", above=0, maximum=1e3)
    """A factor on every Muon update besides --muon-scale-mode's."""
    muon_split_qkv: bool = option(True, "--muon-no-split-qkv", action="store_false")
    """Orthogonalise the fused query/key/value weight as Q, K and V (the default), or as one matrix."""
    muon_split_gate_up: bool = option(True, "--muon-no-split-gate-up", action="store_false")
    """Orthogonalise SwiGLU's fused [gate; up] weight as its two halves (the default), or as one matrix."""
    muon_fp32_matmul_prec: str = option("highest", "--muon-fp32-matmul-prec", choices=("highest", "high", "medium"))
    """Newton-Schulz matmuls: highest in fp32, so every layout gives the dense update to fp32 rounding; high in
    fp32 at torch's "high" matmul precision (TF32 on CUDA); medium in bf16, torch.optim.Muon's (faster on GPUs,
    but the bf16 cast turns the layouts' fp32 rounding differences into bf16-sized ones: 7e-5 relative in the
    third loss of tests/training/test_muon_parallel.py's TP 2 layout, against below 1e-5 at highest)."""
    muon_tp_mode: str = option("duplicated", "--muon-tp-mode", choices=("duplicated", "blockwise"))
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
    """Console, TensorBoard and metrics records."""

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
            saved = {RENAMED_FIELDS.get(k, k): v for k, v in data.get(f.name, {}).items()}
            values = {k: _tuples(v) for k, v in saved.items() if k in known}
            sections[f.name] = section_cls(**values)
        return cls(**sections)


RENAMED_FIELDS = {"layernorm_epsilon": "norm_epsilon"}
"""Field names of configs saved by earlier versions (checkpoints) -> today's names."""


def flag_fields() -> Iterator[Tuple[str, dataclasses.Field]]:
    """(section name, field) of every field a flag sets, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            if "flag" in f.metadata:
                yield section.name, f


def flag_for(name: str) -> str:
    """A field's flag by field name (unique over the sections): micro_batch_size -> --micro-batch-size;
    a field without a flag (a derived one) gets its name in flag form."""
    for _, f in flag_fields():
        if f.name == name:
            return f.metadata["flag"]
    return "--" + name.replace("_", "-")


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
