"""Our dense GPT-2-block GPT <-> Hugging Face `GPT2LMHeadModel`: the parameter mapping and the config.

GPT-2's block is ours without the Llama options: learned absolute positions, pre-LayerNorm blocks, GeLU
(exact, or the tanh approximation OpenAI's GPT-2 uses with --openai-gelu: Hugging Face's gelu_new), a head
tied to the word embedding, biases everywhere. Layer i is our module 1 + i:

    word_embeddings / position_embeddings      -> transformer.wte / transformer.wpe
    input_layernorm / post_attention_layernorm -> h.i.ln_1 / h.i.ln_2
    attention.query_key_value  [3h, h]         -> h.i.attn.c_attn  (Conv1D: weight [h, 3h])
    attention.dense            [h, h]          -> h.i.attn.c_proj
    mlp.dense_h_to_4h / mlp.dense_4h_to_h      -> h.i.mlp.c_fc / h.i.mlp.c_proj
    final LayerNorm                            -> transformer.ln_f

GPT-2's Conv1D computes x W + b, so every linear weight is transposed. Our dense fused QKV is [Q; K; V]
with heads contiguous inside each, which is how GPT-2 splits c_attn's output into q, k, v and then heads.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_mapping
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import real, refusal, refuse_gpt_oss_parts, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig

ARCHITECTURES = ("GPT2LMHeadModel",)
FLAGS = "--num-layers, --hidden-size, --ffn-hidden-size, --max-position-embeddings, --vocab-size"
# Causal-mask buffers older GPT-2 files carry; derived, not weights.
DERIVED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
"""transformers' activation_function -> --openai-gelu."""


def check_gpt2(m: ModelConfig) -> None:
    """Refuse, with the reason, a GPT-2-block model GPT2LMHeadModel cannot hold."""
    refuse_gpt_oss_parts(m, "GPT2LMHeadModel")
    if m.gated_linear_unit:
        raise CheckpointError("export-hf: the model's MLP is gated (--swiglu); GPT2LMHeadModel's is a GeLU MLP "
                              "(the Llama-family block exports as LlamaForCausalLM)")
    if m.position_embedding_type != "learned_absolute":
        raise CheckpointError(f"export-hf: the model uses --position-embedding-type {m.position_embedding_type} "
                              f"(rotary); GPT2LMHeadModel has learned absolute positions only, and a GPT-NeoX "
                              f"export is not implemented. Only learned_absolute models can be exported")
    if m.untie_embeddings_and_output_weights:
        raise CheckpointError("export-hf: the model was trained with --untie-embeddings-and-output-weights; "
                              "GPT2LMHeadModel ties its output head to the word embedding, so it cannot hold a "
                              "separate head")
    if m.window_size is not None:
        raise CheckpointError(f"export-hf: the model attends through --window-size {m.window_size[0]},0; "
                              f"GPT2LMHeadModel attends globally (the Llama-family block exports windows as "
                              f"MistralForCausalLM)")
    if m.head_dim * m.num_attention_heads != m.hidden_size:
        raise CheckpointError(f"export-hf: the model's heads are --kv-channels {m.kv_channels} wide; "
                              f"GPT2LMHeadModel's are n_embd / n_head = {m.hidden_size // m.num_attention_heads}, so "
                              f"it cannot hold them")


def mapping(m: ModelConfig) -> List[Mapped]:
    h, layers, ffn = m.hidden_size, m.num_layers, m.ffn_hidden_size
    vp, v = m.padded_vocab_size, m.vocab_size or m.padded_vocab_size
    table = [Mapped("layers.0.word_embeddings.weight", (vp, h), ("transformer.wte.weight",), (v,)),
             Mapped("layers.0.position_embeddings.weight", (m.max_position_embeddings, h),
                    ("transformer.wpe.weight",), (m.max_position_embeddings,))]
    for i in range(layers):
        ours, theirs = f"layers.{i + 1}.", f"transformer.h.{i}."
        for a, b in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            table += [Mapped(ours + a + ".weight", (h,), (theirs + b + ".weight",), (h,)),
                      Mapped(ours + a + ".bias", (h,), (theirs + b + ".bias",), (h,))]
        for a, b, rows, cols in (("attention.query_key_value", "attn.c_attn", 3 * h, h),
                                 ("attention.dense", "attn.c_proj", h, h),
                                 ("mlp.dense_h_to_4h", "mlp.c_fc", ffn, h), ("mlp.dense_4h_to_h", "mlp.c_proj", h, ffn)):
            table += [Mapped(ours + a + ".weight", (rows, cols), (theirs + b + ".weight",), (rows,), transposed=True),
                      Mapped(ours + a + ".bias", (rows,), (theirs + b + ".bias",), (rows,))]
    table += [Mapped(f"layers.{layers + 1}.weight", (h,), ("transformer.ln_f.weight",), (h,)),
              Mapped(f"layers.{layers + 1}.bias", (h,), ("transformer.ln_f.bias",), (h,))]
    return table


def hf_name(name: str) -> str:
    """GPT-2 files saved from a bare GPT2Model name tensors without the `transformer.` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def is_derived(name: str) -> bool:
    return name.endswith(DERIVED_SUFFIXES) or name == "lm_head.weight"  # the head is the tied embedding


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    return hf_mapping.to_hf(dense, mapping(m), FLAGS)


def hf_config(m: ModelConfig) -> dict:
    """config.json of the GPT2LMHeadModel that holds our model; bos/eos ids are the caller's (the tokenizer's)."""
    check_gpt2(m)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": m.vocab_size or m.padded_vocab_size, "n_positions": m.max_position_embeddings,
        "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
        "n_inner": m.ffn_hidden_size, "activation_function": "gelu_new" if m.openai_gelu else "gelu",
        "layer_norm_epsilon": m.norm_epsilon, "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout,
        "attn_pdrop": m.attention_dropout, "initializer_range": m.init_method_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
        "use_cache": True, "bos_token_id": None, "eos_token_id": None,
    }


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a GPT2LMHeadModel config.json; a field we cannot represent is refused by name."""
    activation = c.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise refusal(where, "activation_function", activation, f"is not supported: only "
                      f"{', '.join(ACTIVATIONS)} (exact GeLU, or its tanh approximation with --openai-gelu)")
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                        ("tie_word_embeddings", True)):
        if bool(c.get(key, wanted)) != wanted:
            raise refusal(where, key, c.get(key), f"is not supported (GPT-2's block here has {key} = {wanted})")
    hidden = whole(c, "n_embd", where)
    return dict(
        num_layers=whole(c, "n_layer", where), hidden_size=hidden, num_attention_heads=whole(c, "n_head", where),
        ffn_hidden_size=whole(c, "n_inner", where, 4 * hidden), max_position_embeddings=whole(c, "n_positions", where),
        vocab_size=whole(c, "vocab_size", where), norm_epsilon=real(c, "layer_norm_epsilon", where, 1e-5, above=0),
        openai_gelu=ACTIVATIONS[activation], position_embedding_type="learned_absolute",
        init_method_std=real(c, "initializer_range", where, 0.02, above=0),
        hidden_dropout=real(c, "resid_pdrop", where, 0.1, minimum=0, below=1),
        attention_dropout=real(c, "attn_pdrop", where, 0.1, minimum=0, below=1))
