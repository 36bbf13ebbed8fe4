"""ModelConfig's general sections: the shape, vocabulary and dropout; the block (embeddings, initialisation,
norms, MLP activation); the linear layers' biases; activation recompute. `model.py` assembles them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config.option import option

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class ShapeConfig:
    """Layers, widths, heads, sequence, vocabulary and dropout."""
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


@dataclass(frozen=True)
class BlockConfig:
    """Output head, initialisation, normalisation and the MLP's activation."""
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
    output_loss_chunk_size: Optional[int] = option(None, "--output-loss-chunk-size", minimum=1)
    """Compute the output layer and the cross entropy this many tokens at a time, so the last stage never holds
    the [tokens, V/tp] fp32 logits (parallel/chunked_cross_entropy.py); the same losses and gradients, one more
    output GEMM in backward. Not given: the whole head at once."""
    quick_geglu: bool = option(False, "--quick-geglu")
    """Quick-GeLU-gated MLP (gpt-oss): down(quick_gelu(gate(x)) * (up(x) + --glu-linear-offset)) with
    quick_gelu(g) = g * sigmoid(1.702 g); the gate/up layout and --ffn-hidden-size as --swiglu's."""
    glu_linear_offset: float = option(0.0, "--glu-linear-offset", minimum=-1e6, maximum=1e6)
    """Added to the linear (up) half of a gated MLP before the product (gpt-oss: 1); --swiglu or --quick-geglu."""
    activation_func_clamp_value: Optional[float] = option(None, "--activation-func-clamp-value", above=0,
                                                          maximum=1e6)
    """Clamp a gated MLP's halves before the activation: the gate to at most this, the up half to [-this, this]
    (gpt-oss: 7); --swiglu or --quick-geglu. Not given: no clamp."""


@dataclass(frozen=True)
class BiasConfig:
    """Biases of the linear layers."""
    add_bias_linear: bool = option(True, "--disable-bias-linear", action="store_false")
    """Drop the bias of every linear layer (attention and MLP), as Llama does."""
    add_qkv_bias: bool = option(False, "--add-qkv-bias")
    """Give the fused QKV linear a bias even with --disable-bias-linear, as Qwen2 and Qwen2-MoE have (biases
    on q_proj, k_proj and v_proj only); with biases everywhere it changes nothing."""


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute."""
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


@dataclass(frozen=True)
class MultiTokenPredictionConfig:
    """Multi-Token Prediction (DeepSeek-V3, GLM-4.5): depths after the model that predict tokens further ahead
    (model/mtp.py)."""
    mtp_num_layers: Optional[int] = option(None, "--mtp-num-layers", minimum=1)
    """D depths of Multi-Token Prediction on the last pipeline stage: depth k predicts the token k + 1 ahead from
    the embedding of the token k ahead and depth k-1's hidden state, through a decoder layer of the model's kind
    (DeepSeek-V3: 1). Not given: none."""
    mtp_loss_scaling_factor: float = option(0.1, "--mtp-loss-scaling-factor", minimum=0, maximum=1e6)
    """The depths' losses join the language-model loss's gradient as factor / D x their sum (DeepSeek-V3: 0.3,
    then 0.1); the logged loss stays the language model's, the depths' are logged apart."""


COMPILE_BACKENDS = ("inductor", "aot_eager")
"""--compile-backend's choices (model/compile.py compiles with them)."""


@dataclass(frozen=True)
class CompileConfig:
    """torch.compile of the transformer layers (model/compile.py)."""
    compile: bool = option(False, "--compile")
    """Compile each transformer layer with torch.compile (the embedding, head and loss stay eager); graphs and
    graph breaks are reported at the first log line. Off by default until measured faster on the device
    (docs/benchmarks.md)."""
    compile_backend: str = option("inductor", "--compile-backend", choices=COMPILE_BACKENDS)
    """With --compile: inductor (generated fused kernels) or aot_eager (the same traced graphs run by eager
    kernels: checks tracing, no speed-up)."""
